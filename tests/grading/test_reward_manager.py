"""The setgrpo_dual reward manager through verl's own registry, reward-loop worker and DataProto."""

import asyncio
import json

import numpy as np
import pytest
import torch
from scipy.stats import binomtest
from omegaconf import OmegaConf

import verl  # noqa: F401  (loads the setgrpo plugin, which registers the manager)
from setgrpo_verl.grading import DualScorer, GradingItem, Rubric, RubricGrader, check_rule, load_ifbench_rubrics, rubric_score
from setgrpo_verl.integration.reward_manager import (CALLS_METRIC, NO_ANSWER_METRIC, REASKS_METRIC,
                                                     UNPARSED_RATIO_METRIC, grading_metrics)

GRADER = {"type": "local_hf", "temperature": 1.0, "max_question_tokens": 96, "max_response_tokens": 96, "seed": 0}


def _config(grader=GRADER, scorings=None, point=None):
    import importlib.resources

    from setgrpo_verl.models import embedded_model_dir

    # verl's own reward config group (reward/reward.yaml), as main_ppo composes it
    reward = OmegaConf.load(str(importlib.resources.files("verl") / "trainer" / "config" / "reward" / "reward.yaml"))
    reward.num_workers = 1
    reward.reward_manager.name = "setgrpo_dual"
    OmegaConf.set_struct(reward, False)
    if grader is not None:
        reward.reward_kwargs = {"grader": grader}
    if scorings is not None:
        reward.reward_kwargs.scorings = scorings
    if point is not None:
        reward.reward_kwargs.point = point
    return OmegaConf.create({
        "actor_rollout_ref": {"model": {"path": str(embedded_model_dir()), "tokenizer_path": None}},
        "reward": reward,
    })


def _batch(tokenizer, rows, responses, max_prompt=64, max_response=48, sessions=None, nonce_fields=True):
    """verl's per-sample fields for ``rows`` and ``responses``: step 1, row i (``index``) and, unless ``sessions``
    gives them, session 0 of each (``nonce_fields=False``: without step, index and session, as verl's v0 trainer)."""
    from verl import DataProto

    b = len(rows)
    prompts = torch.full((b, max_prompt), tokenizer.pad_token_id)
    resp = torch.full((b, max_response), tokenizer.pad_token_id)
    mask = torch.zeros((b, max_prompt + max_response), dtype=torch.long)
    for i, (row, text) in enumerate(zip(rows, responses)):
        p = tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)[-max_prompt:]
        r = tokenizer.encode(text, add_special_tokens=False)[: max_response - 1] + [tokenizer.eos_token_id]
        prompts[i, max_prompt - len(p):] = torch.tensor(p)
        resp[i, : len(r)] = torch.tensor(r)
        mask[i, max_prompt - len(p): max_prompt + len(r)] = 1
    non_tensors = {
        "data_source": np.array(["ifbench"] * b, dtype=object),
        "reward_model": np.array([{"style": "rubric", "ground_truth": json.dumps(row)} for row in rows], dtype=object),
        "extra_info": np.array([{"index": i, "id": row["id"]} for i, row in enumerate(rows)], dtype=object),
        "uid": np.array(["g0"] * b, dtype=object),
    }
    if nonce_fields:
        non_tensors["global_steps"] = np.array([1] * b)
        non_tensors["index"] = np.array([row.get("index", i) for i, row in enumerate(rows)])
        non_tensors["session_id"] = np.array(sessions if sessions is not None else [0] * b)
    return DataProto.from_dict(tensors={"prompts": prompts, "responses": resp, "attention_mask": mask},
                               non_tensors=non_tensors)


def test_registered_in_verls_reward_loop_registry():
    from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls
    from verl.trainer.ppo.reward import resolve_reward_manager_cls

    from setgrpo_verl.integration.reward_manager import SetGRPODualRewardManager, register

    assert get_reward_manager_cls("setgrpo_dual") is SetGRPODualRewardManager
    assert resolve_reward_manager_cls(_config()) is SetGRPODualRewardManager  # what RewardLoopManager calls
    assert register() is SetGRPODualRewardManager  # idempotent


def test_missing_grader_block_is_a_clear_error():
    from verl.trainer.ppo.reward import load_reward_manager

    with pytest.raises(ValueError, match=r"\+reward.reward_kwargs.grader.type=local_hf"):
        load_reward_manager(_config(grader=None), tokenizer=None)


@pytest.mark.slow
def test_reward_loop_worker_on_real_responses(ifbench_samples, smollm2_judge):
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
    from verl.trainer.ppo.reward import extract_reward

    from setgrpo_verl.integration.reward_manager import SetGRPODualRewardManager, grader_identity, sample_nonce

    config = _config()
    worker = RewardLoopWorker(config)  # verl's reward-loop worker class (what Ray runs), built in-process
    manager = worker.reward_manager
    assert isinstance(manager, SetGRPODualRewardManager)
    assert manager.identity == grader_identity(config) == smollm2_judge.identity | {"name": "rubric+local_hf"}

    rows = load_ifbench_rubrics(limit=4)
    responses = [ifbench_samples[r["question"]] for r in rows]
    data = _batch(worker.input_tokenizer, rows, responses)
    outputs = worker.loop.run_until_complete(worker.compute_score_batch(data))

    # what RewardLoopManager.compute_rm_score does with the outputs
    scores = [o["reward_score"] for o in outputs]
    rm_scores = type(manager).assemble_rm_scores(data, scores)
    infos = [o["reward_extra_info"] for o in outputs]
    keys = list(infos[0])
    from verl import DataProto

    out = DataProto.from_dict(tensors={"rm_scores": rm_scores},
                              non_tensors={k: np.array([info[k] for info in infos]) for k in keys},
                              meta_info={"reward_extra_keys": keys})
    reward_tensor, extra = extract_reward(out)
    assert set(keys) == {"score", "reference_score", "point_verdicts", "reference_verdicts", "unparsed", "judged",
                         "judged_disagreement", "scorings", "no_answer", "reasks", "noise_scale", "grading_error"}
    # judge verdicts of both scorings per response: twice the criteria without a rule
    assert extra["judged"].tolist() == [2 * sum(c.rule is None for c in Rubric.from_row(r).criteria) for r in rows]
    assert grading_metrics({"extra_fields": [{"reward_extra_info": info} for info in infos]}) == {
        UNPARSED_RATIO_METRIC: 0.0, CALLS_METRIC: 8.0, NO_ANSWER_METRIC: 0.0, REASKS_METRIC: 0.0}  # 4 responses x 2 scorings
    valid = data.batch["attention_mask"][:, 64:].sum(-1)
    for i in range(4):
        assert reward_tensor[i, valid[i] - 1].item() == pytest.approx(scores[i])
        assert reward_tensor[i].abs().sum().item() == pytest.approx(abs(scores[i]))
    assert extra["reference_score"].dtype == np.float64 and extra["unparsed"].tolist() == [0] * 4

    # the verdicts explain the scores; rule verdicts are the if-verifiable checks of the decoded response
    texts = [worker.input_tokenizer.decode(data.batch["responses"][i][: valid[i]], skip_special_tokens=True)
             for i in range(4)]
    items = []
    for i, row in enumerate(rows):
        rubric = Rubric.from_row(row)
        sample = {k: v[i] for k, v in data.non_tensor_batch.items()}
        items.append(GradingItem(texts[i], rubric, nonce=sample_nonce(sample)))  # the nonce the manager gave it
        for key, score in (("point_verdicts", scores[i]), ("reference_verdicts", extra["reference_score"][i])):
            verdicts = json.loads(extra[key][i])
            met = [None if v["outcome"] == "unparsed" else v["outcome"] == "met" for v in verdicts]
            assert rubric_score(rubric, met) == pytest.approx(score)
            for crit, v in zip(rubric.criteria, verdicts):
                if crit.rule is not None:
                    assert v["source"] == "rule"
                    assert (v["outcome"] == "met") == check_rule(crit.rule, rubric.question, texts[i])
    # same grader protocol, seed and nonces outside verl give the same point and reference scores
    direct = asyncio.run(DualScorer(RubricGrader(smollm2_judge, seed=0)).ascore(items))
    np.testing.assert_allclose(direct.point, scores)
    np.testing.assert_allclose(direct.reference, extra["reference_score"])


WORDS_RULE = {"id": "ifbench:count:word_count_range", "kwargs": {"min_words": 3, "max_words": 5}}


def test_reward_loop_refuses_a_malformed_rubric_row_naming_it():
    """A rubric row that reaches verl's reward loop with null points (e.g. a parquet written by hand) is refused
    with the row id, criterion index and field -- not scored as if the criterion were absent."""
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    from setgrpo_verl.grading import RubricRowError

    worker = RewardLoopWorker(_config({"type": "rules", "seed": 0}))
    good = {"question": "Describe a cat in a few words.", "id": "rm-good", "rubrics": [
        {"criterion": "Uses 3 to 5 words", "points": 2, "rule": WORDS_RULE}]}
    bad = {"question": "Describe a dog in a few words.", "id": "rm-bad", "rubrics": [
        {"criterion": "Uses 3 to 5 words", "points": 2, "rule": WORDS_RULE},
        {"criterion": "Uses 3 to 5 words again", "points": None, "rule": WORDS_RULE}]}
    texts = ["My cat is soft.", "My dog barks loudly at night."]
    out = worker.loop.run_until_complete(worker.compute_score_batch(_batch(worker.input_tokenizer, [good], texts[:1])))
    assert out[0]["reward_score"] == 1.0  # 4 words: the rule is met, the row scores 2/2
    with pytest.raises(RubricRowError) as info:
        worker.loop.run_until_complete(worker.compute_score_batch(_batch(worker.input_tokenizer, [good, bad], texts)))
    err = info.value
    assert (err.row_id, err.criterion_index, err.field) == ("rm-bad", 1, "points")
    assert "rm-bad" in err.location  # the verl row (extra_info.id) is named too


def test_reward_loop_refuses_a_non_finite_function_score(tmp_path):
    """A verl-style scoring function that returns -inf for an empty answer: GradingError naming the response,
    instead of an inf reward that verl's GRPO turns into NaN advantages for the whole group."""
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    from setgrpo_verl.grading import GradingError

    fn = tmp_path / "reward_fn.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs):\n"
                  "    return float('-inf') if not solution_str.strip() else 1.0 / len(solution_str)\n")
    worker = RewardLoopWorker(_config({"type": "function", "path": str(fn), "name": "compute_score", "seed": 0}))
    rows = [{"question": "Say something.", "id": f"fn-{i}", "rubrics": [{"criterion": "Says something", "points": 1}]}
            for i in range(2)]
    out = worker.loop.run_until_complete(worker.compute_score_batch(_batch(worker.input_tokenizer, rows[:1], ["abcd"])))
    assert out[0]["reward_score"] == 0.25 and out[0]["reward_extra_info"]["reference_score"] == 0.25
    with pytest.raises(GradingError) as info:
        worker.loop.run_until_complete(worker.compute_score_batch(_batch(worker.input_tokenizer, rows, ["abcd", ""])))
    msg = str(info.value)
    assert "-inf" in msg and "'fn-1'" in msg and "response ''" in msg


def test_judge_token_budget_and_chat_template_kwargs_are_grader_keys():
    """The reasoning-judge knobs as Hydra overrides of the reward manager's grader config reach the judge."""
    from verl.trainer.ppo.reward import load_reward_manager

    from setgrpo_verl.integration.reward_manager import grader_identity

    config = _config({"type": "openai", "base_url": "http://127.0.0.1:1/v1", "model": "Qwen/Qwen3-8B"})
    overrides = OmegaConf.from_dotlist(["reward.reward_kwargs.grader.max_tokens=2048",
                                        "reward.reward_kwargs.grader.chat_template_kwargs.enable_thinking=false"])
    config = OmegaConf.merge(config, overrides)
    manager = load_reward_manager(config, tokenizer=None)
    judge = manager.scorer.grader.judge
    assert (judge.max_tokens, judge.chat_template_kwargs) == (2048, {"enable_thinking": False})
    assert manager.identity == grader_identity(config)


def _noisy_rules_scores(**config):
    """The reward loop's output and its reward_extra_info for 12 one-rule rubrics (met, unmet alternately) under a
    noisy grader (flip 0.3) around the rules grader; ``config`` goes to :func:`_config` (e.g. ``scorings=1``)."""
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    grader = {"type": "noisy", "flip_prob": 0.3, "seed": 0, "base": {"type": "rules", "seed": 0}}
    worker = RewardLoopWorker(_config(grader, **config))
    rows = [{"question": f"Describe animal {i} in a few words.", "id": f"n-{i}", "rubrics": [
        {"criterion": "Uses 3 to 5 words", "points": 2, "rule": WORDS_RULE}]} for i in range(12)]
    texts = ["My cat is soft.", "Dogs bark at night and in the morning too."] * 6
    out = worker.loop.run_until_complete(worker.compute_score_batch(_batch(worker.input_tokenizer, rows, texts)))
    return out, [o["reward_extra_info"] for o in out]


def test_noisy_grader_puts_the_truth_into_reward_extra_info():
    """A noisy grader around the rules grader: r and r' follow their flipped verdicts, ``truth_score`` is the
    rules grader's score of the decoded response (docs/validation.md#noisy-grader)."""
    out, infos = _noisy_rules_scores()
    assert [info["truth_score"] for info in infos] == [1.0, 0.0] * 6
    # the noise-free verdicts behind truth_score, with the criteria points, for the calibration's shards
    assert [json.loads(info["truth_verdicts"]) for info in infos] == [
        {"met": [1], "points": [2.0]}, {"met": [0], "points": [2.0]}] * 6
    for o, info in zip(out, infos):
        for key, score in (("point_verdicts", o["reward_score"]), ("reference_verdicts", info["reference_score"])):
            (verdict,) = json.loads(info[key])
            assert verdict["source"] == "noisy:rule" and score == (1.0 if verdict["outcome"] == "met" else 0.0)
    flips = sum(o["reward_score"] != info["truth_score"] for o, info in zip(out, infos))
    assert 0 < flips < 12  # 12 verdicts at flip_prob 0.3: some flipped, not all


def test_point_mean_returns_the_mean_of_the_two_scorings_as_the_reward():
    """``reward.reward_kwargs.point=mean``: verl's GRPO trains on (r + r') / 2 (the grpo_mean2 baseline); the same
    flips as the default, since the point mode changes no grader call."""
    out, infos = _noisy_rules_scores(point="mean")
    first, _ = _noisy_rules_scores()
    for o, f, info in zip(out, first, infos):
        assert o["reward_score"] == (f["reward_score"] + info["reference_score"]) / 2 == info["score"]
    assert {o["reward_score"] for o in out} - {0.0, 1.0}  # some scorings disagree: a half-way mean


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"point": "median"}, r"reward\.reward_kwargs\.point='median': set first .* or mean"),
    ({"point": "mean", "scorings": 1}, r"point=mean averages two scorings, but reward\.reward_kwargs\.scorings=1"),
])
def test_point_modes_other_than_first_and_mean_are_refused(kwargs, message):
    from verl.trainer.ppo.reward import load_reward_manager

    with pytest.raises(ValueError, match=message):
        load_reward_manager(_config({"type": "rules", "seed": 0}, **kwargs), tokenizer=None)


def test_sample_nonce_names_step_row_and_session():
    from setgrpo_verl.integration.reward_manager import sample_nonce

    assert sample_nonce({"global_steps": np.int64(3), "index": np.int64(17), "session_id": 2, "uid": "u"}) == "3/17/2"
    assert sample_nonce({"global_steps": 3, "index": 17}) is None  # verl's v0 trainer: no session_id


def test_noisy_grader_flips_copies_of_one_response_independently():
    """The K responses of one prompt with the same text (a sharpened policy) get independent flips: the sessions
    differ, so the nonces do; without verl's step, row and session fields the noisy grader refuses."""
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    from setgrpo_verl.grading import GradingError

    grader = {"type": "noisy", "flip_prob": 0.3, "seed": 0, "base": {"type": "rules", "seed": 0}}
    worker = RewardLoopWorker(_config(grader))
    row = {"question": "Describe a cat in a few words.", "id": "cat", "index": 5, "rubrics": [
        {"criterion": "Uses 3 to 5 words", "points": 2, "rule": WORDS_RULE}]}
    k = 40
    data = _batch(worker.input_tokenizer, [row] * k, ["My cat is soft."] * k, sessions=list(range(k)))
    out = worker.loop.run_until_complete(worker.compute_score_batch(data))
    assert [o["reward_extra_info"]["truth_score"] for o in out] == [1.0] * k
    flipped = sum(o["reward_score"] == 0.0 for o in out)
    assert binomtest(flipped, k, 0.3).pvalue > 0.01, flipped  # one shared draw would give 0 or 40
    again = worker.loop.run_until_complete(worker.compute_score_batch(data))
    assert [o["reward_score"] for o in again] == [o["reward_score"] for o in out]  # reproducible
    bare = _batch(worker.input_tokenizer, [row], ["My cat is soft."], nonce_fields=False)
    with pytest.raises(GradingError, match="has no nonce"):
        worker.loop.run_until_complete(worker.compute_score_batch(bare))


def _counting_worker(tmp_path, scorings):
    """verl's reward-loop worker around a function grader that appends its scoring index to a file per call."""
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    calls = tmp_path / "calls.txt"
    fn = tmp_path / "counting_fn.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info, scoring_index, **kwargs):\n"
                  f"    with open({str(calls)!r}, 'a') as f:\n"
                  "        f.write(f'{extra_info[\"id\"]} {scoring_index}\\n')\n"
                  "    return 1.0 / len(solution_str)\n")
    grader = {"type": "function", "path": str(fn), "name": "compute_score", "seed": 0}
    return RewardLoopWorker(_config(grader, scorings=scorings)), calls


def _scored(worker, n):
    rows = [{"question": f"Say something {i}.", "id": f"c-{i}", "rubrics": [{"criterion": "Says it", "points": 1}]}
            for i in range(n)]
    data = _batch(worker.input_tokenizer, rows, ["abcd"] * n)
    return worker.loop.run_until_complete(worker.compute_score_batch(data))


@pytest.mark.parametrize("scorings", [None, 2])
def test_two_scorings_call_the_grader_twice_per_response(tmp_path, scorings):
    """The default and ``scorings=2``: scoring indices 0 and 1 for every response, the reference score present."""
    worker, calls = _counting_worker(tmp_path, scorings)
    out = _scored(worker, 3)
    assert sorted(calls.read_text().split("\n")[:-1]) == [f"c-{i} {s}" for i in range(3) for s in (0, 1)]
    infos = [o["reward_extra_info"] for o in out]
    assert [o["reward_score"] for o in out] == [0.25] * 3
    assert [(i["reference_score"], i["scorings"]) for i in infos] == [(0.25, 2)] * 3
    assert grading_metrics({"extra_fields": [{"reward_extra_info": i} for i in infos]})[CALLS_METRIC] == 6.0


def test_one_scoring_calls_the_grader_once_per_response_and_gives_no_reference(tmp_path):
    worker, calls = _counting_worker(tmp_path, 1)
    out = _scored(worker, 3)
    assert sorted(calls.read_text().split("\n")[:-1]) == ["c-0 0", "c-1 0", "c-2 0"]
    infos = [o["reward_extra_info"] for o in out]
    assert [o["reward_score"] for o in out] == [0.25] * 3
    assert set(infos[0]) == {"score", "point_verdicts", "unparsed", "judged", "scorings", "no_answer", "reasks",
                             "noise_scale", "grading_error"}
    assert [(i["score"], i["scorings"], i["judged"], i["unparsed"], i["no_answer"]) for i in infos] == [
        (0.25, 1, 0, 0, 0)] * 3
    assert grading_metrics({"extra_fields": [{"reward_extra_info": i} for i in infos]}) == {
        UNPARSED_RATIO_METRIC: 0.0, CALLS_METRIC: 3.0, NO_ANSWER_METRIC: 0.0, REASKS_METRIC: 0.0}


@pytest.mark.parametrize("value", [0, 3, "1", 1.0, True])
def test_scorings_other_than_1_or_2_are_refused_naming_the_key(value):
    from verl.trainer.ppo.reward import load_reward_manager

    with pytest.raises(ValueError, match=r"reward\.reward_kwargs\.scorings=.*set 1 .* or 2"):
        load_reward_manager(_config({"type": "rules", "seed": 0}, scorings=value), tokenizer=None)


def test_noisy_grader_with_one_scoring_keeps_the_truth():
    """One scoring of a noisy grader: the point score follows its flipped verdict, truth_score and truth_verdicts
    are the rules grader's, and no reference is invented."""
    out, infos = _noisy_rules_scores(scorings=1)
    assert [info["truth_score"] for info in infos] == [1.0, 0.0] * 6
    assert [json.loads(info["truth_verdicts"]) for info in infos] == [
        {"met": [1], "points": [2.0]}, {"met": [0], "points": [2.0]}] * 6
    assert not any("reference_score" in info or "reference_verdicts" in info for info in infos)
    for o, info in zip(out, infos):
        (verdict,) = json.loads(info["point_verdicts"])
        assert verdict["source"] == "noisy:rule" and o["reward_score"] == (1.0 if verdict["outcome"] == "met" else 0.0)
    # the same nonces draw the same flips as the point scoring of two scorings
    again, _ = _noisy_rules_scores(scorings=2)
    assert [o["reward_score"] for o in again] == [o["reward_score"] for o in out]


def test_calls_metric_leaves_out_padding_rows_and_reads_top_level_counts():
    """verl's padding copies are not grader calls; the colocated path's top-level arrays count the same."""
    info = {"unparsed": 1, "judged": 4, "scorings": 2}
    tags = [{}, {}, {"is_padding": True}]
    assert grading_metrics({"extra_fields": [{"reward_extra_info": info}] * 3}, tags) == {
        UNPARSED_RATIO_METRIC: 0.25, CALLS_METRIC: 4.0}
    top = {"unparsed": np.array([1, 0]), "judged": np.array([2, 2]), "scorings": np.array([1, 1])}
    assert grading_metrics(top) == {UNPARSED_RATIO_METRIC: 0.25, CALLS_METRIC: 2.0}
    # another reward manager's batch: no counts, no metric
    assert grading_metrics({"extra_fields": [{"reward_extra_info": {"acc": 1.0}}] * 2}) == {}
    # the layout the trainers read from TransferQueue: per-sample extra_fields in a TensorDict
    from verl.utils import tensordict_utils as tu

    data = tu.list_of_dict_to_tensordict([{"rm_scores": torch.zeros(3), "extra_fields": {"reward_extra_info": {
        "unparsed": 0, "judged": 2, "scorings": 1}}} for _ in range(5)])
    assert grading_metrics(data) == {UNPARSED_RATIO_METRIC: 0.0, CALLS_METRIC: 5.0}
