"""The one compatibility check of stored calibration data (a record, a shard) against a run or another part
(docs/record.md#compatibility-with-a-run), and which run-identity fields older records and shards lack."""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["ABSENT_AS", "IDENTITY_SINCE_6", "IdentityWarning", "check_identity"]

#: Run-identity keys added with schema 6 (docs/record.md#run-identity), by record field; None: every key of the
#: field. A record or shard written before lacks them: each is named in an :class:`IdentityWarning`, not refused.
IDENTITY_SINCE_6 = {"policy": ("weights", "weights_sha256", "tokenizer_sha256", "custom_chat_template_sha256",
                               "chat_template_kwargs", "top_k", "repetition_penalty", "dtype", "prompt_length",
                               "prompt_filter", "model_config_sha256"),
                    "training": None}
#: Identity keys that name, for people, what was calibrated, and are never compared: ``policy.model`` is the
#: configured path (the weights are compared by ``policy.weights_sha256``).
_INFORMATIVE = {"policy": ("model",)}
#: Identity keys added within schema 6, and the value a record or shard without the key was made with:
#: ``policy.model_overrides``, the model config overrides (none before the key existed); ``policy.ignore_eos``
#: (verl's default, False).
ABSENT_AS = {("policy", "model_overrides"): {}, ("policy", "ignore_eos"): False}


class IdentityWarning(UserWarning):
    """A record or shard written before some run-identity fields existed: those fields are not checked."""


def _since_6(name: str, key: str | None = None) -> bool:
    """Whether identity field ``name`` (or its key ``key``) was added with schema 6."""
    if name not in IDENTITY_SINCE_6:
        return False
    keys = IDENTITY_SINCE_6[name]
    return keys is None or (key is not None and key in keys)


def check_identity(stored: dict[str, Any], current: dict[str, Any], *, what: str, holder: str,
                   fix: str | None = None, sources: dict[str, str] | None = None) -> None:
    """The one compatibility check of stored calibration data (a record, a shard) against a run or another part
    (docs/record.md#compatibility-with-a-run).

    Args:
        stored: field -> value as the data holds them (records: record fields; shards: the shard identity).
        current: field -> value of the run (or part) they are compared with; each key of ``current`` is checked,
            dict fields key by key in ``current``'s order (``policy.model``, the path, is never compared).
        what: the data named in the message (``"calibration record"``, ``"calibration shard <file>"``).
        holder: what the stored side is called in the message (``"record"``, ``"shard"``).
        fix: what to do instead, in the message; default: recalibrate or run with the stored value.
        sources: field (``"policy.top_k"``) -> the config key that sets it, named after the field.

    Raises:
        ValueError: naming the first mismatched field (for dict fields the first differing key, as
            ``name.key``; a key the stored side lacks that predates schema 6 is named as written before that field
            existed; one in :data:`ABSENT_AS` reads as the value it was made with), the config key behind it, both
            values, why it matters and the fix.

    Warns:
        IdentityWarning: once, naming every schema-6 identity field (:data:`IDENTITY_SINCE_6`) the stored side
            lacks: written before those fields existed, so they are not checked.
    """
    owner = f"{holder}'s"
    sources = sources or {}
    missing: list[str] = []
    for name, value in current.items():
        if name not in stored and _since_6(name):
            missing.append(name)
            continue
        mine = stored.get(name)
        if isinstance(mine, dict) and isinstance(value, dict):
            skip = _INFORMATIVE.get(name, ())
            for k in [k for k in [*value, *(k for k in mine if k not in value)] if k not in skip]:
                if (k not in mine or k not in value) and _since_6(name, k):  # either side may be the older one
                    missing.append(f"{name}.{k}")
                    continue
                rec, cur = mine.get(k, ABSENT_AS.get((name, k))), value.get(k, ABSENT_AS.get((name, k)))
                if rec == cur:
                    continue
                why = ("the coverage and risk guarantees hold only for the grader that was calibrated"
                       if name == "grader" else "the calibration was made under other settings")
                # a key the stored side lacks was added after it was written: no setting of this run gives it
                if k in mine:
                    has, fix_k = f"{holder} has {rec!r}", f"recalibrate for this run or run with the {owner} {name}.{k}"
                elif (name, k) in ABSENT_AS:
                    has, fix_k = (f"{holder} has no {name}.{k} (written before that field existed, so read as {rec!r})",
                                  "recalibrate for this run")
                else:
                    has, fix_k = f"{holder} has no {name}.{k} (written before that field existed)", \
                        "recalibrate for this run"
                source = f" ({sources[f'{name}.{k}']})" if f"{name}.{k}" in sources else ""
                raise ValueError(f"{what} mismatch in {name}.{k}{source}: {has}, this run has {cur!r}; {why} - "
                                 f"{fix or fix_k}")
        elif mine != value:
            source = f" ({sources[name]})" if name in sources else ""
            raise ValueError(
                f"{what} mismatch in {name}{source}: {holder} has {mine!r}, this run has {value!r}; "
                f"{fix or f'recalibrate for this setting or run with the {owner} value'}"
            )
    if missing:
        warnings.warn(f"{what} has no {', '.join(missing)}: it was written before these identity fields existed, so "
                      "they are not checked against this run (docs/record.md#older-records); recalibrate to have "
                      "them checked", IdentityWarning, stacklevel=3)
