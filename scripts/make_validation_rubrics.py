"""Make the composite validation rubrics of ``setgrpo-verl validate`` (docs/validation.md#validation-rubrics).

Each prompt is a short everyday task (:data:`TASKS` x :data:`TOPICS`) followed by 3 to 6 instructions that
if-verifiable checks by code (:data:`CANDIDATES`: rule id -> kwargs choices, drawn per prompt), each a rule
criterion with its own number of points (distinct integers from :data:`POINTS`), so a rubric score takes many
values and one flipped verdict rarely reverses a group.

Two steps, both deterministic from their seeds::

    python scripts/make_validation_rubrics.py measure   # slow: samples the embedded policy
    python scripts/make_validation_rubrics.py compose   # seconds: needs the tokenizer only
    python scripts/make_validation_rubrics.py compose --rows 16500 --out rubrics.jsonl  # the paper profile's rows
    python scripts/make_validation_rubrics.py check     # optional: degenerate groups on the shipped rows

``measure`` composes prompts from every candidate type, samples K responses per prompt from the embedded policy
(SmolLM2-135M-Instruct, chat template, temperature 1, top-p 1, no top-k: verl's rollout settings) with
:data:`MAX_NEW_TOKENS` new tokens (``data.max_response_length`` of the validate profile), checks every instruction
and writes ``setgrpo_verl/data/validation_rubrics_met_rates.json``: the settings, and per type the met rate (over
all samples), the disagreement rate (share of prompts whose K samples do not all agree on it) and whether it is
kept (met rate within :data:`MET_RANGE` and disagreement >= :data:`MIN_DISAGREEMENT`) and why.

``compose`` reads that table and writes ``setgrpo_verl/data/validation_rubrics.jsonl`` (RubricHub rows
``{"id": "ifcomp-0000", "question", "rubrics"}``) from the kept types only; with ``--rows N --out FILE`` it writes
N rows elsewhere, the shipped rows first (one seeded stream). Every prompt fits
:data:`MAX_PROMPT_TOKENS` tokens with the policy's chat template (the validate profile's ``data.max_prompt_length``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from pathlib import Path

from setgrpo_verl.grading import Criterion, GradingError, Rubric, Rule, check_rule, rubric_score
from setgrpo_verl.grading.rules import rule_description

DATA = Path(__file__).resolve().parents[1] / "setgrpo_verl" / "data"
MET_RATES_FILE = DATA / "validation_rubrics_met_rates.json"
RUBRICS_FILE = DATA / "validation_rubrics.jsonl"

MAX_NEW_TOKENS = 48  # response length of the validate profile (data.max_response_length)
MAX_PROMPT_TOKENS = 128  # prompt length of the validate profile (data.max_prompt_length), chat template included
SAMPLES = 4  # K responses per prompt (actor_rollout_ref.rollout.n of the validate profile)
TEMPERATURE, TOP_P = 1.0, 1.0
CRITERIA = (3, 6)  # fewest and most instructions per prompt
POINTS = range(1, 7)  # each criterion's points: distinct integers from here
MET_RANGE = (0.15, 0.85)
MIN_DISAGREEMENT = 0.3
ROWS = 3000
COMPOSE_SEED = 0  # the shipped file's seed

#: Everyday topics: (phrase, a noun a response about it is likely to use, related words it may use).
TOPICS = (
    ("a morning cup of coffee", "coffee", ("cup", "morning", "taste")),
    ("a walk in the park", "park", ("trees", "walk", "fresh")),
    ("a rainy afternoon", "rain", ("umbrella", "window", "cozy")),
    ("cooking pasta for dinner", "pasta", ("water", "sauce", "boil")),
    ("a weekend at the beach", "beach", ("sand", "waves", "sun")),
    ("keeping a small garden", "garden", ("plants", "soil", "flowers")),
    ("the first day at a new job", "job", ("colleagues", "nervous", "office")),
    ("riding a bicycle to work", "bicycle", ("helmet", "traffic", "exercise")),
    ("a birthday party for a friend", "party", ("cake", "gift", "friends")),
    ("cleaning the kitchen", "kitchen", ("dishes", "sink", "clean")),
    ("reading a book before bed", "book", ("sleep", "story", "night")),
    ("a visit to the dentist", "dentist", ("teeth", "appointment", "brush")),
    ("adopting a puppy", "puppy", ("dog", "toys", "train")),
    ("a snowy winter day", "snow", ("cold", "coat", "winter")),
    ("planning a family dinner", "dinner", ("family", "table", "recipe")),
    ("moving to a new apartment", "apartment", ("boxes", "neighbors", "rent")),
    ("learning a new language", "language", ("words", "practice", "grammar")),
    ("a long train journey", "train", ("ticket", "window", "station")),
    ("saving money each month", "money", ("budget", "save", "bank")),
    ("a picnic with friends", "picnic", ("basket", "sandwiches", "blanket")),
    ("growing tomatoes", "tomatoes", ("seeds", "sun", "water")),
    ("a trip to the grocery store", "store", ("list", "food", "milk")),
    ("baking bread at home", "bread", ("flour", "oven", "dough")),
    ("a quiet evening at home", "home", ("relax", "tea", "music")),
    ("starting to run in the morning", "run", ("shoes", "pace", "breath")),
    ("writing a letter to a friend", "letter", ("friend", "paper", "news")),
    ("fixing a flat tire", "tire", ("wheel", "pump", "road")),
    ("a day at the zoo", "zoo", ("animals", "lion", "children")),
    ("watching the sunset", "sunset", ("sky", "orange", "evening")),
    ("organizing a messy closet", "closet", ("clothes", "shelves", "space")),
    ("taking care of a houseplant", "plant", ("leaves", "light", "water")),
    ("a thunderstorm at night", "storm", ("thunder", "lightning", "rain")),
    ("making a cup of tea", "tea", ("kettle", "leaves", "warm")),
    ("visiting your grandparents", "grandparents", ("stories", "family", "visit")),
    ("preparing for an exam", "exam", ("study", "notes", "sleep")),
    ("a camping trip in the mountains", "camping", ("tent", "fire", "stars")),
    ("going to a concert", "concert", ("music", "crowd", "band")),
    ("painting a bedroom wall", "paint", ("color", "brush", "wall")),
    ("a busy Monday morning", "Monday", ("coffee", "work", "busy")),
    ("feeding birds in winter", "birds", ("seeds", "feeder", "winter")),
)
#: Base tasks; ``{topic}`` is a topic phrase.
TASKS = (
    "Write a short paragraph about {topic}.",
    "Describe {topic} to a friend.",
    "Give some advice about {topic}.",
    "Write a short story about {topic}.",
    "Explain what you like about {topic}.",
)
#: Forbidden-word pairs: common words, none a topic word (so no prompt asks for and forbids the same word).
FORBIDDEN_PAIRS = (("very", "really"), ("also", "just"), ("important", "great"), ("good", "best"),
                   ("many", "help"), ("enjoy", "like"))

#: Candidate instruction types: rule id -> {kwarg: choices}. A key "a/b" draws a and b jointly from pairs;
#: the strings "{noun}" and "{word}" stand for the topic's noun and one of its related words.
CANDIDATES: dict[str, dict[str, list]] = {
    "ifeval:punctuation:no_comma": {},
    "ifeval:length_constraints:number_words": {"num_words": [30, 35, 40], "relation": ["less than", "at least"]},
    "ifbench:count:word_count_range": {"min_words/max_words": [[20, 35], [25, 40], [30, 45]]},
    "ifbench:count:unique_word_count": {"N": [25, 30]},
    "ifeval:keywords:letter_frequency": {
        "letter/let_frequency": [["e", 18], ["t", 14], ["a", 12], ["o", 11], ["s", 9], ["n", 10], ["i", 11]],
        "let_relation": ["less than", "at least"]},
    "ifeval:keywords:existence": {"keywords": [["{noun}"], ["{word}"]]},
    "ifeval:keywords:frequency": {"keyword": ["{noun}"], "frequency": [2, 3], "relation": ["less than", "at least"]},
    "ifeval:keywords:forbidden_words": {"forbidden_words": [list(p) for p in FORBIDDEN_PAIRS]},
    "ifbench:sentence:keyword": {"word": ["{noun}"], "N": [1, 2]},
    "ifbench:count:conjunctions": {"small_n": [1, 2]},
    "ifbench:count:pronouns": {"N": [2, 3]},
    "ifbench:count:numbers": {"N": [1]},
    "ifbench:words:repeats": {"small_n": [2, 3]},
    "ifbench:words:no_consecutive": {},
    "ifeval:detectable_format:number_highlighted_sections": {"num_highlights": [1, 2]},
    "ifeval:detectable_format:number_bullet_lists": {"num_bullets": [2, 3]},
    "ifeval:detectable_format:title": {},
    "ifeval:detectable_content:number_placeholders": {"num_placeholders": [1]},
    "ifeval:detectable_content:postscript": {"postscript_marker": ["P.S."]},
    "ifeval:startend:quotation": {},
    "ifeval:startend:end_checker": {"end_phrase": ["Any other questions?"]},
    "ifbench:format:emoji": {},
    "ifbench:ratio:sentence_type": {},
}
#: Types that constrain the same quantity: at most one per prompt (e.g. "less than 30 words" and "at least 30
#: unique words" cannot both hold).
FAMILIES = {"ifeval:length_constraints:number_words": "length", "ifbench:count:word_count_range": "length",
            "ifbench:count:unique_word_count": "length"}
#: Instruction types left out before measuring, and why.
NOT_MEASURED = {
    "ifeval:length_constraints:number_sentences": "needs NLTK's punkt data (LookupError offline)",
    "ifeval:change_case:capital_word_frequency": "needs NLTK's punkt data (word_tokenize; LookupError offline)",
    "ifbench:words:keywords_specific_position": "needs NLTK's punkt data (word_tokenize; LookupError offline)",
    "ifeval:change_case:english_lowercase": "langdetect verdicts are random (no seed): not deterministic",
    "ifeval:change_case:english_capital": "langdetect verdicts are random (no seed): not deterministic",
    "ifeval:language:response_language": "langdetect verdicts are random (no seed): not deterministic",
    "ifbench:count:person_names": "its description (50 names) alone takes ~150 tokens",
    **{f"ifbench:{i}": "needs NLTK data (setgrpo_verl.grading.rules.NLTK_DATA_RULES)"
       for i in ("ratio:stop_words", "words:start_verb", "format:title_case", "words:words_position")},
}
SAMPLE_RESPONSES = ("", "Hello, world.", "<<A title>>\n* one\n* two\nP.S. 3 birds, 12 seeds 🙂", '"All quiet."')


def _conflicts() -> dict[str, set[str]]:
    """ifeval's conflict table, made symmetric (a copy: if-verifiable's own dict is left as it is)."""
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_CONFLICTS

    table = {f"ifeval:{k}": {f"ifeval:{x}" for x in v} for k, v in INSTRUCTION_CONFLICTS.items()}
    for key, others in list(table.items()):
        for other in others:
            table.setdefault(other, set()).add(key)
    return table


def conflict(a: str, b: str, table: dict[str, set[str]]) -> bool:
    """Whether rule types ``a`` and ``b`` may not share a prompt (same type, same family, or ifeval's table)."""
    return a == b or (a in FAMILIES and FAMILIES.get(a) == FAMILIES.get(b)) or b in table.get(a, ())


def draw_kwargs(rng: random.Random, spec: dict[str, list], topic: tuple) -> dict:
    """One kwargs dict from a :data:`CANDIDATES` spec for ``topic`` (placeholders resolved)."""
    _, noun, words = topic
    word = rng.choice(words)

    def resolve(value):
        if isinstance(value, list):
            return [resolve(v) for v in value]
        return {"{noun}": noun, "{word}": word}.get(value, value) if isinstance(value, str) else value

    out = {}
    for key, choices in spec.items():
        choice = resolve(rng.choice(choices))
        out.update(zip(key.split("/"), choice) if "/" in key else [(key, choice)])
    return out


def prompt_tokens(tokenizer, question: str) -> int:
    """Length in tokens of ``question`` as one user turn with the chat template and the generation prompt."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return len(ids)


def draw_prompt(rng: random.Random, types: list[str], tokenizer, table: dict[str, set[str]]):
    """A question and its rules: a base task and 3-6 compatible instructions that fit :data:`MAX_PROMPT_TOKENS`.

    Returns ``(question, [Rule])``, or ``None`` when fewer than 3 instructions fit (the caller draws again).
    """
    topic = rng.choice(TOPICS)
    task = rng.choice(TASKS).format(topic=topic[0])
    n = rng.randint(*CRITERIA)
    chosen: list[str] = []
    for rule_id in rng.sample(types, len(types)):
        if len(chosen) < n and not any(conflict(rule_id, c, table) for c in chosen):
            chosen.append(rule_id)
    rules = [Rule(r, draw_kwargs(rng, CANDIDATES[r], topic)) for r in chosen]
    while len(rules) >= CRITERIA[0]:
        question = "\n".join([task] + [rule_description(r) for r in rules])
        if prompt_tokens(tokenizer, question) <= MAX_PROMPT_TOKENS:
            return question, rules
        rules.remove(max(rules, key=lambda r: len(rule_description(r))))  # drop the longest instruction
    return None


def criterion_text(rule) -> str:
    return "The response follows this instruction: " + " ".join(rule_description(rule).split())


def offline_failure(rule_id: str) -> str | None:
    """Why the checker of ``rule_id`` cannot run offline on :data:`SAMPLE_RESPONSES` (None when it can)."""
    rule = Rule(rule_id, draw_kwargs(random.Random(0), CANDIDATES[rule_id], TOPICS[0]))
    try:
        for response in SAMPLE_RESPONSES:
            check_rule(rule, "Say something.", response)
    except (GradingError, ValueError) as exc:
        return f"checker fails offline: {exc}"
    return None


def generate(model, tokenizer, questions: list[str], *, seed: int, batch_prompts: int) -> list[list[str]]:
    """:data:`SAMPLES` sampled responses per question (verl's rollout settings), decoded without special tokens."""
    import torch

    out = []
    for start in range(0, len(questions), batch_prompts):
        chunk = questions[start:start + batch_prompts]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False) for q in chunk for _ in range(SAMPLES)]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        torch.manual_seed(seed + start)  # each batch seeded: a run can be checked batch by batch
        with torch.no_grad():
            gen = model.generate(**enc, do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, top_k=0,
                                 max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.pad_token_id)
        decoded = tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        out += [decoded[i * SAMPLES:(i + 1) * SAMPLES] for i in range(len(chunk))]
        print(f"  generated {start + len(chunk)}/{len(questions)} prompts", file=sys.stderr, flush=True)
    return out


def measure(args: argparse.Namespace) -> None:
    import torch

    from setgrpo_verl.models import EMBEDDED_MODEL_NAME, load_causal_lm

    started = time.time()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_causal_lm()
    table = _conflicts()
    types, entries = [], {}
    for rule_id in CANDIDATES:
        failure = offline_failure(rule_id)
        if failure:
            entries[rule_id] = {"kept": False, "why": failure}
        else:
            types.append(rule_id)
    rng = random.Random(args.seed)
    prompts = []
    while len(prompts) < args.prompts:
        drawn = draw_prompt(rng, types, tokenizer, table)
        if drawn is not None:
            prompts.append(drawn)
    responses = generate(model, tokenizer, [q for q, _ in prompts], seed=args.seed, batch_prompts=args.batch)
    # per prompt, per instruction: the verdicts of its K samples
    checked = [[[check_rule(rule, q, r) for r in group] for rule in rules]
               for (q, rules), group in zip(prompts, responses)]
    verdicts: dict[str, list[list[bool]]] = {t: [] for t in types}
    for (_, rules), per_rule in zip(prompts, checked):
        for rule, group in zip(rules, per_rule):
            verdicts[rule.id].append(group)
    lo, hi = MET_RANGE
    for rule_id in types:
        groups = verdicts[rule_id]
        met = sum(map(sum, groups)) / max(1, SAMPLES * len(groups))
        disagree = sum(0 < sum(g) < SAMPLES for g in groups) / max(1, len(groups))
        why = (f"met rate {met:.2f} outside [{lo}, {hi}]" if not lo <= met <= hi else
               f"disagreement {disagree:.2f} < {MIN_DISAGREEMENT}" if disagree < MIN_DISAGREEMENT else
               "informative: met rate and disagreement within the bounds")
        entries[rule_id] = {"prompts": len(groups), "met_rate": round(met, 4), "disagreement": round(disagree, 4),
                            "kept": why.startswith("informative"), "why": why}
    entries.update({r: {"kept": False, "why": f"not measured: {why}"} for r, why in NOT_MEASURED.items()})
    # what the kept types would give: degenerate groups (all K scores equal) among the measured prompts that keep
    # at least 3 kept instructions, scored with distinct points as compose draws them
    prng, degenerate = random.Random(args.seed), []
    for (_, rules), per_rule in zip(prompts, checked):
        kept_groups = [g for rule, g in zip(rules, per_rule) if entries[rule.id]["kept"]]
        if len(kept_groups) >= CRITERIA[0]:
            points = prng.sample(POINTS, len(kept_groups))
            scores = {sum(p for p, met in zip(points, sample) if met) for sample in zip(*kept_groups)}
            degenerate.append(len(scores) == 1)
    summary = {"prompts_with_3_kept_types": len(degenerate),
               "degenerate_share": round(sum(degenerate) / max(1, len(degenerate)), 4)}
    if args.dump:
        with open(args.dump, "w", encoding="utf-8") as f:
            for (q, rules), group, per_rule in zip(prompts, responses, checked):
                f.write(json.dumps({"question": q, "rules": [r.to_dict() for r in rules], "responses": group,
                                    "verdicts": per_rule}, ensure_ascii=False) + "\n")
    settings = {"policy": EMBEDDED_MODEL_NAME, "dtype": "float32", "chat_template": True,
                "max_new_tokens": MAX_NEW_TOKENS, "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": None,
                "samples_per_prompt": SAMPLES, "prompts": len(prompts), "seed": args.seed,
                "criteria_per_prompt": list(CRITERIA), "max_prompt_tokens": MAX_PROMPT_TOKENS,
                "met_range": list(MET_RANGE), "min_disagreement": MIN_DISAGREEMENT,
                "torch_threads": args.threads, "seconds": round(time.time() - started, 1)}
    types_out = {r: {**entries[r], "kwargs_choices": CANDIDATES.get(r)} for r in sorted(entries)}
    MET_RATES_FILE.write_text(json.dumps({"settings": settings, "summary": summary, "types": types_out}, indent=1)
                              + "\n", encoding="utf-8")
    for r, e in types_out.items():
        print(f"{r:55s} {e.get('met_rate', '-')!s:>7} {e.get('disagreement', '-')!s:>7}  {e['why']}")
    print(f"wrote {MET_RATES_FILE} in {settings['seconds']} s; {summary}")


def distinct_scores(points: list[float]) -> int:
    """Number of distinct values of sum(points of a subset) / sum(points) over all subsets."""
    total = sum(points)
    return len({round(sum(s) / total, 9) for k in range(len(points) + 1) for s in itertools.combinations(points, k)})


def compose_rows(met_rates: dict, *, seed: int, rows: int, tokenizer) -> list[dict]:
    """The validation rubric rows from a met-rate table (the kept types), deterministic in ``seed``.

    Raises:
        ValueError: the table was measured with other kwargs choices than :data:`CANDIDATES` has now, or keeps
            fewer types than a prompt needs; re-run ``measure``.
    """
    kept = sorted(r for r, e in met_rates["types"].items() if e["kept"])
    changed = [r for r in kept if met_rates["types"][r].get("kwargs_choices") != CANDIDATES.get(r)]
    if changed:
        raise ValueError(f"{MET_RATES_FILE.name} was measured with other kwargs for {changed}; re-run measure")
    if len(kept) < CRITERIA[1]:
        raise ValueError(f"{MET_RATES_FILE.name} keeps {len(kept)} types, fewer than {CRITERIA[1]}: widen the "
                         "kwargs choices of the candidates and re-run measure")
    rng, table, out, seen = random.Random(seed), _conflicts(), [], set()
    while len(out) < rows:
        drawn = draw_prompt(rng, kept, tokenizer, table)
        if drawn is None or drawn[0] in seen:
            continue
        question, rules = drawn
        seen.add(question)
        points = rng.sample(POINTS, len(rules))
        criteria = tuple(Criterion(criterion_text(r), float(p), r) for r, p in zip(rules, points))
        row = Rubric(question=question, id=f"ifcomp-{len(out):04d}", criteria=criteria).to_row()
        out.append({"id": row.pop("id"), **row})
    return out


def compose(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from setgrpo_verl.models import embedded_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir()), local_files_only=True)
    met_rates = json.loads(MET_RATES_FILE.read_text(encoding="utf-8"))
    rows = compose_rows(met_rates, seed=args.seed, rows=args.rows, tokenizer=tokenizer)
    out = Path(args.out)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    n = [len(r["rubrics"]) for r in rows]
    values = [distinct_scores([c["points"] for c in r["rubrics"]]) for r in rows]
    print(f"wrote {len(rows)} rows to {out}: {sum(n) / len(n):.2f} criteria and "
          f"{sum(values) / len(values):.2f} distinct score values per prompt on average")


def check(args: argparse.Namespace) -> None:
    """Sample the policy on the first shipped rows: per-type met rates there and the share of degenerate groups."""
    import torch

    from setgrpo_verl.models import load_causal_lm

    torch.set_num_threads(args.threads)
    model, tokenizer = load_causal_lm()
    rubrics = [Rubric.from_row(json.loads(line))
               for line in RUBRICS_FILE.read_text(encoding="utf-8").splitlines()[:args.rows]]
    responses = generate(model, tokenizer, [r.question for r in rubrics], seed=args.seed, batch_prompts=args.batch)
    met: dict[str, list[bool]] = {}
    degenerate = 0
    for rubric, group in zip(rubrics, responses):
        verdicts = [[check_rule(c.rule, rubric.question, r) for c in rubric.criteria] for r in group]
        for c, column in zip(rubric.criteria, zip(*verdicts)):
            met.setdefault(c.rule.id, []).extend(column)
        degenerate += len({rubric_score(rubric, v) for v in verdicts}) == 1
    for rule_id, values in sorted(met.items()):
        print(f"{rule_id:55s} met {sum(values) / len(values):.2f} over {len(values)} samples")
    print(f"degenerate groups: {degenerate}/{len(rubrics)} = {degenerate / len(rubrics):.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    m = sub.add_parser("measure", help="sample the policy and write the met-rate table (slow)")
    m.add_argument("--prompts", type=int, default=400, help="measurement prompts (each sampled K times)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--batch", type=int, default=16, help="prompts per generation batch")
    m.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    m.add_argument("--dump", help="also write every prompt, response and verdict to this .jsonl file")
    c = sub.add_parser("compose", help="write the rubric rows from the met-rate table (fast)")
    c.add_argument("--seed", type=int, default=COMPOSE_SEED)
    c.add_argument("--rows", type=int, default=ROWS)
    c.add_argument("--out", default=str(RUBRICS_FILE),
                   help="output .jsonl (default: the shipped file); e.g. more rows for --profile paper")
    k = sub.add_parser("check", help="sample the policy on the first shipped rows and report degenerate groups")
    k.add_argument("--rows", type=int, default=200)
    k.add_argument("--seed", type=int, default=1)
    k.add_argument("--batch", type=int, default=16)
    k.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    {"measure": measure, "compose": compose, "check": check}[args.step](args)


if __name__ == "__main__":
    main()
