"""The judge protocol: the versioned prompt, the reply shapes we read and the verdict vocabulary
(docs/grading.md#judge-protocol and #unparsed-verdicts).

Prompt: :data:`JUDGE_SYSTEM_PROMPT` + :data:`JUDGE_USER_TEMPLATE`, versioned by :data:`JUDGE_TEMPLATE_VERSION` (it
enters :func:`template_hash`, hence the calibration record). The judge is told to answer with one English word.

Reply shapes (:func:`read_reply`, one chat-completion ``message``): ``content`` as a string; ``content`` as a list of
text parts (joined), reasoning parts (``thinking``) among them skipped; ``content`` null or empty with the answer in ``reasoning_content`` or ``reasoning`` (vLLM /
SGLang reasoning parsers, e.g. Qwen3 with ``enable_thinking=false``). The answer is what the judge said, never with
text of ours added. Any other shape -- tool calls, a refusal, non-text parts, a content of another type -- is a
:class:`~.types.GradingError` that names the shape and quotes the reply.

Verdicts (:func:`parse_verdict`, docs/grading.md#reading-a-verdict): after any ``<think>...</think>`` block, the
verdict markers of the answer -- one verdict word of :data:`VERDICT_WORDS` (English, Chinese, Japanese, Korean and
the common European languages, case-insensitive) as the whole answer, in a JSON field, after a label, as the first
word before a separator or as the last line -- when there is one and all agree; anything else is unparsed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from .types import GradingError

__all__ = [
    "JUDGE_SYSTEM_PROMPT",
    "JUDGE_TEMPLATE_VERSION",
    "JUDGE_USER_TEMPLATE",
    "SAID_CHARS",
    "VERDICT_WORDS",
    "VERDICT_WORDS_BY_LANGUAGE",
    "JudgeReply",
    "JudgeRequest",
    "gather_or_cancel",
    "judge_messages",
    "parse_verdict",
    "read_reply",
    "said",
    "strip_reasoning",
    "REASONING_MARKERS",
    "template_hash",
]

#: Version of the judge prompt protocol; bump when any text below changes (it enters ``template_hash``).
JUDGE_TEMPLATE_VERSION = "setgrpo-judge-v2"
JUDGE_SYSTEM_PROMPT = (
    "You are a strict grader. You decide whether a response meets one rubric criterion. "
    "Reply with exactly one English word, yes or no, whatever the language of the question and the response."
)
# The criterion comes last so that everything before it is shared by all criteria of a response (local judge:
# computed once per response; HTTP servers with prefix caching profit the same way).
JUDGE_USER_TEMPLATE = (
    "Question:\n{question}\n\nResponse:\n{response}\n\n"
    "Does the response meet this criterion? Answer yes or no.\nCriterion: {criterion}"
)
RESPONSE_SPLIT = "\n\nResponse:\n"
CRITERION_SPLIT = "\nCriterion: "

#: The verdict words read as yes / no, per language (docs/grading.md#unparsed-verdicts). Matching is on the whole
#: answer, case-insensitive; a word means the same in every language that has it.
VERDICT_WORDS_BY_LANGUAGE: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "English": (("yes",), ("no",)),
    "Chinese": (("是", "是的", "对", "符合", "满足"), ("否", "不是", "不对", "不符合", "不满足")),
    "Japanese": (("はい",), ("いいえ",)),
    "Korean": (("예", "네"), ("아니요", "아니오")),
    "Spanish": (("sí", "si"), ("no",)),
    "Portuguese": (("sim",), ("não", "nao")),
    "French": (("oui",), ("non",)),
    "Italian": (("sì", "si"), ("no",)),
    "German": (("ja",), ("nein",)),
    "Dutch": (("ja",), ("nee",)),
    "Swedish / Danish / Norwegian": (("ja",), ("nej", "nei")),
    "Finnish": (("kyllä",), ("ei",)),
    "Polish": (("tak",), ("nie",)),
    "Czech / Slovak": (("ano", "áno"), ("ne", "nie")),
    "Croatian / Serbian / Slovenian": (("da",), ("ne",)),
    "Romanian": (("da",), ("nu",)),
    "Hungarian": (("igen",), ("nem",)),
    "Greek": (("ναι",), ("όχι",)),
    "Russian": (("да",), ("нет",)),
    "Ukrainian": (("так",), ("ні",)),
    "Turkish": (("evet",), ("hayır",)),
}


def _verdict_words() -> dict[str, bool]:
    words: dict[str, bool] = {}
    for language, (yes, no) in VERDICT_WORDS_BY_LANGUAGE.items():
        for word, meaning in [(w, True) for w in yes] + [(w, False) for w in no]:
            key = word.casefold()
            if words.get(key, meaning) != meaning:
                raise ValueError(f"verdict word {word!r} ({language}) means yes in one language and no in another")
            words[key] = meaning
    return words


#: Every verdict word (casefolded) -> True (yes) / False (no).
VERDICT_WORDS: dict[str, bool] = _verdict_words()
_FINAL_PUNCTUATION = ".!。！"
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
#: Other spellings of a reasoning block's opening and closing markers (Magistral's ``[THINK]``, Seed-OSS's
#: ``<seed:think>``), read as ``<think>`` / ``</think>`` in a judge's reply and a policy's response alike.
REASONING_MARKERS = (("[THINK]", "[/THINK]"), ("<seed:think>", "</seed:think>"))
#: How many characters of a judge's reply error messages quote.
SAID_CHARS = 200


@dataclass(frozen=True)
class JudgeRequest:
    """One judge question: does ``response`` (to ``question``) meet ``criterion``?"""

    question: str
    response: str
    criterion: str


def template_hash(**protocol: Any) -> str:
    """sha256 (16 hex digits) of the judge protocol: template version, system and user templates, plus any
    protocol settings given as keyword arguments (e.g. truncation limits)."""
    payload = json.dumps(
        {"version": JUDGE_TEMPLATE_VERSION, "system": JUDGE_SYSTEM_PROMPT, "user": JUDGE_USER_TEMPLATE, **protocol},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def judge_messages(request: JudgeRequest) -> list[dict[str, str]]:
    """The chat messages (system + user) of the versioned judge prompt for one request."""
    user = JUDGE_USER_TEMPLATE.format(question=request.question, response=request.response, criterion=request.criterion)
    return [{"role": "system", "content": JUDGE_SYSTEM_PROMPT}, {"role": "user", "content": user}]


def strip_reasoning(text: str | None) -> str | None:
    """The answer part of a judge reply: the text after the last ``</think>``, or the whole text when there is no
    thinking block; ``None`` when a ``<think>`` block is never closed (the reply stopped while reasoning). The other
    spellings of :data:`REASONING_MARKERS` (``[THINK]...[/THINK]`` from a server without the model's reasoning parser)
    are read as ``<think>...</think>``.

    A closing tag without an opening one is handled too: some chat templates put ``<think>`` into the prompt, so the
    reply starts inside the reasoning."""
    if text is None:
        return None
    for opening, closing in REASONING_MARKERS:
        text = text.replace(opening, _THINK_OPEN).replace(closing, _THINK_CLOSE)
    low = text.lower()
    close = low.rfind(_THINK_CLOSE)
    if close >= 0:
        return text[close + len(_THINK_CLOSE):]
    if _THINK_OPEN in low:
        return None
    return text


def parse_verdict(text: str | None, *, cut: bool = False) -> bool | None:
    """``True`` (yes), ``False`` (no) or ``None`` (no verdict read): the verdict a judge's answer clearly gives
    (docs/grading.md#reading-a-verdict).

    A reasoning block ``<think>...</think>`` before the answer is skipped (:func:`strip_reasoning`; an unclosed one
    gives ``None``). Then the answer's verdict markers are collected, each one word of :data:`VERDICT_WORDS`
    (case-insensitive) standing alone:

    * the whole answer, after markdown and markup are taken off (``**Yes**``, ``\\boxed{no}``, ``[[Yes]]``,
      ``<answer>no</answer>``, ``"yes"``);
    * a field ``verdict``, ``answer``, ``judgment``, ``decision``, ``result``, ``met``, ... of a JSON object (in a
      code fence or not), whose value is a verdict word or a JSON boolean;
    * a word after a label: ``Verdict: yes``, ``Final answer - No``, ``the answer is yes``, ``答案：是``;
    * the answer's first word, followed by a separator (``Yes, the response ...``, ``No. It lacks ...``,
      ``はい、...``);
    * a last line that is the word alone (reasoning first, then ``Yes``).

    The verdict is read when there is at least one marker and all markers agree; markers that disagree (``Yes, ...
    Final answer: no``) give ``None``. A word is a marker only where it ends: on a reply cut by the token budget
    (``cut=True``, ``finish_reason="length"``) the end of the text is not a word's end (``No`` may have been
    ``Not``), so a word there counts only with a separator after it, and a cut JSON object is not read.

    Args:
        text: the judge's answer (reasoning included, if the server left it there); ``None`` for none.
        cut: the reply ended on the token budget.
    """
    answer = strip_reasoning(text)
    if answer is None:
        return None
    markers = _verdict_markers(answer, cut)
    return markers.pop() if len(markers) == 1 else None


_WORD_CHARS = r"[^\W_]"
#: Separators after a first-word verdict (ASCII and CJK punctuation, a line break).
_SEPARATOR = r"(?:[,.;:!)\]\-\u2014\u2013\u3001\u3002\uff0c\uff1a\uff01]|\n)"
_LABELS = (r"final\s+(?:verdict|answer|decision|judg(?:e)?ment)|verdict|answer|judg(?:e)?ment|decision|result|"
           r"conclusion|criterion\s+met|meets?\s+(?:the\s+)?criterion|答案|结论|判断|回答|结果|判定|答え|결론|답변|판정|"
           r"antwort|urteil|réponse|verdicto|respuesta|veredicto|resposta|risposta|ответ|вердикт")
_LABEL_RE = re.compile(rf"(?:{_LABELS})(?:\s*(?:is|was|would\s+be|:|：|=|-|\u2014))+\s*", re.IGNORECASE)
#: A bracketed label (Prometheus' ``[RESULT] Yes``) reads as ``RESULT: Yes``.
_BRACKET_LABEL = re.compile(r"\[(result|verdict|answer|decision)\]", re.IGNORECASE)
_JSON_FIELDS = ("verdict", "answer", "judgment", "judgement", "decision", "result", "met", "meets", "meets_criterion",
                "criterion_met", "criteria_met", "satisfied", "label", "pass", "passed", "final_answer", "final_verdict")
_MARKUP = re.compile(r"\\boxed\{([^{}]*)\}|</?[A-Za-z_][\w-]*>|[*_`#>\[\]\"'“”‘’「」『』«»]")


def _plain(text: str) -> str:
    """``text`` without markdown emphasis, code ticks, headings, quotes, brackets and XML-like tags; ``\\boxed{x}``
    becomes ``x``."""
    return _MARKUP.sub(lambda m: m.group(1) or " ", text)


def _word_verdict(word: str) -> bool | None:
    word = word.strip()
    while word and word[-1] in _FINAL_PUNCTUATION + ",;:":
        word = word[:-1].rstrip()
    return VERDICT_WORDS.get(word.casefold())


def _json_verdicts(answer: str) -> set[bool]:
    """Verdicts of the named fields of the JSON objects in ``answer`` (a complete object only)."""
    found: set[bool] = set()
    decoder = json.JSONDecoder()
    start = answer.find("{")
    while start >= 0:
        try:
            obj, end = decoder.raw_decode(answer, start)
        except ValueError:
            start = answer.find("{", start + 1)
            continue
        if isinstance(obj, dict):
            for key, value in obj.items():
                if str(key).casefold() in _JSON_FIELDS:
                    if isinstance(value, bool):
                        found.add(value)
                    elif isinstance(value, str) and _word_verdict(_plain(value)) is not None:
                        found.add(_word_verdict(_plain(value)))
        start = answer.find("{", end)
    return found


def _leading_word(text: str, cut: bool) -> bool | None:
    """The verdict of ``text``'s first word when a separator follows it (or the text ends there, unless cut)."""
    longest = None
    for word, meaning in VERDICT_WORDS.items():
        if text[:len(word)].casefold() != word:
            continue
        rest = text[len(word):]
        ends = re.match(_SEPARATOR, rest) is not None or (not rest.strip() and not cut)
        if ends and re.match(_WORD_CHARS, rest) is None and (longest is None or len(word) > len(longest[0])):
            longest = (word, meaning)
    return None if longest is None else longest[1]


def _verdict_markers(answer: str, cut: bool) -> set[bool]:
    """Every verdict marker of ``answer`` (see :func:`parse_verdict`)."""
    markers = _json_verdicts(answer)
    plain = _plain(_BRACKET_LABEL.sub(r"\1:", answer)).strip()
    if not plain:
        return markers
    whole = _word_verdict(plain)
    if whole is not None and not (cut and plain[-1:].isalpha()):
        markers.add(whole)
        return markers
    for match in _LABEL_RE.finditer(plain):
        meaning = _leading_word(plain[match.end():], cut)
        if meaning is not None:
            markers.add(meaning)
    first = _leading_word(plain, cut)
    if first is not None:
        markers.add(first)
    lines = [line.strip() for line in plain.splitlines() if line.strip()]
    if len(lines) > 1 and not cut:
        last = _word_verdict(lines[-1])
        if last is not None:
            markers.add(last)
    return markers


def said(text: str | None) -> str:
    """The start of what a judge said, for error messages."""
    if text is None or text == "":
        return "nothing (no content)"
    return repr(text[:SAID_CHARS]) + (f" ... ({len(text)} characters)" if len(text) > SAID_CHARS else "")


@dataclass(frozen=True)
class JudgeReply:
    """What a judge said in one chat-completion message.

    Attributes:
        answer: the text the verdict is read from (``None`` or ``""`` when the judge said nothing).
        reasoning: reasoning a server-side parser split off (``reasoning_content`` / ``reasoning``), else ``None``.
        shape: which reply shape it was, e.g. ``"content string"`` (for messages and the docs' table).
    """

    answer: str | None
    reasoning: str | None
    shape: str


_TEXT_PART_TYPES = ("text", "output_text")
#: Content parts that carry a reasoning judge's reasoning, not its answer (Mistral's API for Magistral: a
#: ``thinking`` part before the ``text`` part).
_REASONING_PART_TYPES = ("thinking", "reasoning")


def _part_text(part: Any) -> str:
    """The text of a content part, nested parts included (Mistral's ``thinking`` part holds a list of text parts)."""
    if isinstance(part, Mapping):
        part = next((part[k] for k in ("text", "thinking", "reasoning", "content") if k in part), "")
    return part if isinstance(part, str) else "".join(map(_part_text, part)) if isinstance(part, list) else ""


def read_reply(message: Mapping[str, Any], *, where: str = "the judge") -> JudgeReply:
    """The judge's answer in one chat-completion ``message`` (module docstring lists the shapes;
    docs/grading.md#judge-protocol).

    Args:
        message: ``choices[0].message`` of the completion, as a JSON object.
        where: who replied (judge model and URL), for error messages.

    Returns:
        :class:`JudgeReply`; its ``answer`` is the judge's own text, unchanged.

    Raises:
        GradingError: a reply of another shape (tool calls, a refusal, non-text content parts, content of another
            type); the message names the shape and quotes the reply.
    """
    reasoning = None
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if isinstance(value, str) and value:
            reasoning = value
            break
    tool_calls = message.get("tool_calls") or message.get("function_call")
    if tool_calls:
        raise GradingError(
            f"{where} replied with a tool call instead of a text verdict: tool_calls={_quote(tool_calls)}, content "
            f"{said(_text_or_none(message.get('content')))}. The judge must answer in text (yes or no): do not offer "
            "it tools, or use a server / chat template without automatic tool calls"
        )
    refusal = message.get("refusal")
    if isinstance(refusal, str) and refusal.strip():
        raise GradingError(f"{where} refused to judge: refusal={said(refusal)}; use a judge model that grades this "
                           "content, or drop the criterion")
    content = message.get("content")
    if isinstance(content, str) and content:
        return JudgeReply(content, reasoning, "content string")
    if isinstance(content, list):
        kinds = [p.get("type") if isinstance(p, Mapping) else type(p).__name__ for p in content]
        text = [p for p in content if isinstance(p, Mapping) and p.get("type") in _TEXT_PART_TYPES and
                isinstance(p.get("text"), str)]
        thinking = [p for p in content if isinstance(p, Mapping) and p.get("type") in _REASONING_PART_TYPES]
        if content and len(text) + len(thinking) == len(content):
            if thinking:
                reasoning = reasoning or _part_text(thinking) or None
            if text:
                shape = "content parts" + (" after reasoning parts" if thinking else "")
                return JudgeReply("".join(p["text"] for p in text), reasoning, shape)
            return JudgeReply(None, reasoning, "content parts, reasoning only")
        raise GradingError(f"{where} replied with content parts of types {kinds} ({_quote(content)}); only text "
                           "parts carry a verdict and reasoning parts (thinking) are skipped")
    if content is None or content == "":
        if reasoning is not None:
            field = "reasoning_content" if message.get("reasoning_content") else "reasoning"
            return JudgeReply(reasoning, reasoning, f"content null, answer in {field}")
        return JudgeReply(None, None, "empty content")
    raise GradingError(f"{where} replied with content of type {type(content).__name__} ({_quote(content)}); expected "
                       "a string or a list of text parts")


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _quote(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text[:SAID_CHARS] + (f" ... ({len(text)} characters)" if len(text) > SAID_CHARS else "")


async def gather_or_cancel(coros):
    """``asyncio.gather`` that cancels (and awaits) the remaining tasks when one fails: nothing is left in flight.

    Returns:
        The results in order, as ``asyncio.gather``.

    Raises:
        The first exception of any awaited coroutine (after the others are cancelled).
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
