"""The frozen calibration record (docs/algorithm.md#7-record): written once by ``calibrate``, read at training start."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._grpo import DEGENERATE_RTOL
from ._settings import ABLATIONS, ON_INFEASIBLE
from ._srgo import infeasible_text, select_threshold

#: Version 2 added ``degenerate_rtol`` (the degeneracy tolerance that calibration used and training applies);
#: version 3 added ``calibration_prompts`` (what the record was calibrated on).
SCHEMA_VERSION = 3
_HASH_KEY = "content_sha256"
_PROMPT_KEYS = ("id", "question_sha256", "rubric_sha256")
#: Packages whose major.minor a record is compared against when it is read (others are informative only).
_VERSIONED = ("setgrpo-verl", "verl")
_RECORDED = ("setgrpo-verl", "torch", "scipy", "verl")


class RecordVersionWarning(UserWarning):
    """A record written by another major.minor version of setgrpo-verl or verl (read, but worth a look)."""


def package_versions() -> dict[str, str]:
    """Installed versions of setgrpo-verl, torch, scipy and verl (``{name: version}``, missing ones left out)."""
    out = {}
    for name in _RECORDED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(str(version).split("+")[0].split(".")[:2])


def question_key(question: str) -> str:
    """A question's text as prompts are compared: whitespace runs collapsed to one space, case folded."""
    return " ".join(str(question).split()).casefold()


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def prompt_fingerprint(prompt_id: Any, question: str, rubric: Any) -> dict[str, str]:
    """``{"id", "question_sha256", "rubric_sha256"}`` of one calibration prompt (docs/record.md#fields).

    Args:
        prompt_id: the prompt's id (stored as a string).
        question: its question text; hashed after :func:`question_key`, so that a training row with the same
            question up to whitespace and case is recognised.
        rubric: its rubric (any JSON value, e.g. the list of criteria); hashed as canonical JSON.
    """
    body = json.dumps(rubric, sort_keys=True, ensure_ascii=True, default=str)
    return {"id": str(prompt_id), "question_sha256": _sha256(question_key(question)), "rubric_sha256": _sha256(body)}


@dataclass(frozen=True)
class CalibrationRecord:
    """Frozen result of JRSC + SRGO calibration; apply it with ``setgrpo_coefficients``.

    Guarantees (exchangeability of calibration groups and training groups, same grader protocol
    and policy): ``P(T(r'_new) in C_new) >= 1 - alpha`` (coverage of the coefficient set with
    radius ``q_alpha``) and, with probability >= ``1 - delta`` over the risk-calibration groups,
    the conditional direction-reversal risk of accepted groups at ``tau_sel`` is <= ``beta``.

    Per-threshold arrays (length m, aligned with ``tau_grid``): ``n_accepted`` N_j,
    ``n_reversals`` F_j, ``ucb`` (Clopper-Pearson at ``1 - delta/m``), ``utility`` U_j.
    ``degenerate_rtol`` is the relative tolerance of the degeneracy test (docs/algorithm.md#1-grpo-map,
    :func:`setgrpo_verl.core.degenerate_groups`) used to leave groups out of calibration; training
    applies the same value, so a group's status never changes between the phases.
    ``tau_sel`` is None only when calibration found no risk-feasible threshold and the user chose
    ``on_infeasible="reject_all"``: such a record rejects every group.
    ``calibration_prompts`` names what the record was calibrated on: one :func:`prompt_fingerprint`
    (id, question hash, rubric hash) per calibration prompt, empty when the caller gave none;
    :meth:`check_disjoint` refuses training prompts among them.

    The paper's Table 4 columns are the properties ``N``, ``F``, ``ecr`` and ``U`` together with
    ``n_cov``, ``n_risk``, ``q_alpha`` and ``tau_sel`` (see :meth:`table4_row`).
    """

    alpha: float
    beta: float
    delta: float
    rho: float
    q_alpha: float
    n_cov: int
    n_risk: int
    n_degenerate: int
    tau_grid: tuple[float, ...]
    n_accepted: tuple[int, ...]
    n_reversals: tuple[int, ...]
    ucb: tuple[float, ...]
    utility: tuple[float, ...]
    tau_sel: float | None
    K: int
    norm_by_std: bool
    eps: float
    coverage_risk_set: float
    split_seed: int = 0
    grid_size: int = 100
    ablation: str | None = None
    on_infeasible: str = "error"
    loss_agg_mode: str = "token-mean"
    sketch: dict = field(default_factory=dict)
    grader: dict = field(default_factory=dict)
    policy: dict = field(default_factory=dict)
    package_versions: dict = field(default_factory=dict)
    created_at: str = ""
    degenerate_rtol: float = DEGENERATE_RTOL
    calibration_prompts: tuple = ()
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _validate(self)

    # ----------------------------------------------------------------- Table 4 view
    @property
    def sel_index(self) -> int | None:
        """Index of ``tau_sel`` in ``tau_grid`` (None for a reject-all record)."""
        return None if self.tau_sel is None else self.tau_grid.index(self.tau_sel)

    @property
    def N(self) -> int:  # noqa: N802 - the paper's column name
        """Accepted risk-calibration groups at tau_sel (0 for a reject-all record)."""
        return 0 if self.sel_index is None else self.n_accepted[self.sel_index]

    @property
    def F(self) -> int:  # noqa: N802
        """Accepted groups that reversed (b*^T M a' < 0) at tau_sel."""
        return 0 if self.sel_index is None else self.n_reversals[self.sel_index]

    @property
    def ecr(self) -> float:
        """Empirical conditional risk F / N at tau_sel (NaN when N = 0)."""
        return self.F / self.N if self.N else math.nan

    @property
    def U(self) -> float:  # noqa: N802
        """Normalised cumulative recovery at tau_sel."""
        return 0.0 if self.sel_index is None else self.utility[self.sel_index]

    @property
    def ucb_sel(self) -> float:
        """Clopper-Pearson upper bound at tau_sel (1 for a reject-all record)."""
        return 1.0 if self.sel_index is None else self.ucb[self.sel_index]

    def selection_text(self) -> str:
        """One line on SRGO's threshold (docs/algorithm.md#4-srgo): the selected tau and its bound, or, for a
        reject-all record, that no threshold is risk-feasible, the smallest bound, and that no group updates."""
        if self.tau_sel is not None:
            return f"tau_sel={self.tau_sel:.2f}, UCB {self.ucb_sel:.4f} <= beta={self.beta}"
        why = infeasible_text(self.tau_grid, self.n_accepted, self.n_reversals, self.ucb, beta=self.beta)
        return (f"no risk-feasible threshold: {why}, so this record accepts no group and SetGRPO updates nothing; "
                "more calibration groups or a larger beta may certify one")

    def table4_row(self) -> dict[str, Any]:
        """The paper's Table 4 row: Cov., Risk, Q_alpha, tau_sel, N, F, ECR, U."""
        return {"Cov.": self.n_cov, "Risk": self.n_risk, "Qα": self.q_alpha, "τsel": self.tau_sel,
                "N": self.N, "F": self.F, "ECR": self.ecr, "U": self.U}

    # ----------------------------------------------------------------- compatibility
    def check_compatible(self, **run: Any) -> None:
        """Refuse to train with a record calibrated for a different run.

        Keyword arguments name record fields (``K``, ``norm_by_std``, ``eps``, ``loss_agg_mode``,
        ``grader``, ``sketch``, ``policy``, ``ablation``, ...); each given value must equal the
        record's. Dict fields are compared key by key, and the first differing key is named.

        Raises:
            ValueError: naming the first mismatched field, both values, and the fix.
        """
        for name, value in run.items():
            if not hasattr(self, name) or name.startswith("_"):
                raise ValueError(f"calibration record has no field {name!r}")
            mine = getattr(self, name)
            if isinstance(mine, dict) and isinstance(value, dict):
                diff = {k: (mine.get(k), value.get(k)) for k in set(mine) | set(value) if mine.get(k) != value.get(k)}
                if diff:
                    k, (rec, cur) = sorted(diff.items())[0]
                    why = ("the coverage and risk guarantees hold only for the grader that was calibrated"
                           if name == "grader" else "the calibration was made under other settings")
                    raise ValueError(
                        f"calibration record mismatch in {name}.{k}: record has {rec!r}, this run has {cur!r}; {why} - "
                        f"recalibrate for this run or run with the record's {name}.{k}"
                    )
            elif mine != value:
                raise ValueError(
                    f"calibration record mismatch in {name}: record has {mine!r}, this run has {value!r}; "
                    "recalibrate for this setting or run with the record's value"
                )

    def check_disjoint(self, prompts: Any, *, source: str = "the training data") -> None:
        """Refuse training prompts that the record was calibrated on (docs/record.md#compatibility-with-a-run).

        Args:
            prompts: iterable of ``(id, question)`` pairs of the training prompts (id may be None).
            source: where they come from, for the message (e.g. a file name).

        Raises:
            ValueError: naming the first calibration prompt found in ``prompts`` (by id or by question text), how
                many there are, and the fix.
        """
        if not self.calibration_prompts:
            return
        ids = {p["id"]: p for p in self.calibration_prompts}
        questions = {p["question_sha256"]: p for p in self.calibration_prompts}
        found = []
        for prompt_id, question in prompts:
            by_id = ids.get(str(prompt_id)) if prompt_id is not None else None
            by_text = questions.get(_sha256(question_key(question))) if question is not None else None
            if by_id is not None or by_text is not None:
                found.append((prompt_id, question, "id" if by_id is not None else "question text",
                              (by_id or by_text)["id"]))
        if found:
            prompt_id, question, how, cal_id = found[0]
            text = " ".join(str(question).split())
            raise ValueError(
                f"{source} contains {len(found)} prompt(s) this record was calibrated on, the first {prompt_id!r} "
                f"(same {how} as calibration prompt {cal_id!r}: {text[:80]!r}); calibration prompts must stay out "
                "of training (their groups certify the guarantees for fresh prompts): remove them from the "
                "training data or recalibrate on disjoint prompts"
            )

    def version_mismatch(self, installed: dict[str, str] | None = None) -> str | None:
        """Why this record comes from another major.minor of setgrpo-verl or verl than ``installed`` (default: the
        installed packages), naming both versions; None when they agree or a version is unknown."""
        installed = package_versions() if installed is None else installed
        diffs = [f"{name} {self.package_versions[name]} (installed {installed[name]})" for name in _VERSIONED
                 if name in self.package_versions and name in installed
                 and _major_minor(self.package_versions[name]) != _major_minor(installed[name])]
        if not diffs:
            return None
        return (f"calibration record written by {', '.join(diffs)}: its math and run identity are checked, but "
                "the calibration may differ from what this version would compute; recalibrate to be sure")

    # ----------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: all fields, the Table 4 summary, and a content hash."""
        d = dataclasses.asdict(self)
        d["summary"] = {"N": self.N, "F": self.F, "ecr": None if math.isnan(self.ecr) else self.ecr,
                        "U": self.U, "ucb_sel": self.ucb_sel}
        d[_HASH_KEY] = _content_hash(d)
        return d

    def to_json(self, path: str | os.PathLike) -> None:
        """Write the record as indented JSON (atomically: a temp file renamed into place)."""
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2, ensure_ascii=False)
            fh.write("\n")
        os.replace(tmp, path)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CalibrationRecord:
        """Rebuild and validate a record from :meth:`to_dict` output.

        Warns:
            RecordVersionWarning: the record comes from another major.minor of setgrpo-verl or verl
                (:meth:`version_mismatch`).

        Raises:
            ValueError: unknown schema version, missing/unknown fields, a content hash that does not
                match (the file was edited), or values that violate the record's invariants.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a calibration record is a JSON object, got a JSON {type(data).__name__}")
        data = dict(data)
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(
                f"calibration record schema_version is {data.get('schema_version')!r}, this package reads "
                f"{SCHEMA_VERSION}; recalibrate with this version"
            )
        stored = data.pop(_HASH_KEY, None)
        if stored is None or stored != _content_hash({**data}):
            raise ValueError(
                "calibration record content hash does not match: the file was modified after calibration "
                "(or is truncated); a frozen record must not be edited - recalibrate instead"
            )
        summary = data.pop("summary", None)
        names = {f.name for f in dataclasses.fields(cls)}
        missing, unknown = names - set(data), set(data) - names
        if missing or unknown:
            raise ValueError(f"calibration record fields wrong: missing {sorted(missing)}, unknown {sorted(unknown)}")
        for key in ("tau_grid", "n_accepted", "n_reversals", "ucb", "utility", "calibration_prompts"):
            data[key] = tuple(data[key])
        record = cls(**data)
        if summary is not None and (summary.get("N"), summary.get("F")) != (record.N, record.F):
            raise ValueError("calibration record summary (N, F) disagrees with its per-threshold counts")
        mismatch = record.version_mismatch()
        if mismatch:
            warnings.warn(mismatch, RecordVersionWarning, stacklevel=2)
        return record

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> CalibrationRecord:
        """Load and validate a record written by :meth:`to_json` (errors as :meth:`from_dict`)."""
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            raise ValueError(f"calibration record {os.fspath(path)!r} does not exist; run calibration first") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"calibration record {os.fspath(path)!r} is not valid JSON: {exc}") from None
        return cls.from_dict(data)


def _content_hash(d: dict[str, Any]) -> str:
    body = {k: v for k, v in d.items() if k != _HASH_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


def _validate(r: CalibrationRecord) -> None:
    def fail(msg: str) -> None:
        raise ValueError(f"invalid calibration record: {msg}")

    for name in ("alpha", "beta", "delta"):
        v = getattr(r, name)
        if not (0.0 < v < 1.0):
            fail(f"{name}={v} must lie in (0, 1)")
    if not (r.q_alpha >= 0 and math.isfinite(r.q_alpha)):
        fail(f"q_alpha={r.q_alpha} must be finite and >= 0")
    if r.K < 2:
        fail(f"K={r.K} must be >= 2")
    if isinstance(r.degenerate_rtol, bool) or not isinstance(r.degenerate_rtol, (int, float)) or not (
            0.0 <= r.degenerate_rtol < 1.0):
        fail(f"degenerate_rtol={r.degenerate_rtol!r} must be a number in [0, 1)")
    if r.n_cov < 1 or r.n_risk < 1 or r.n_degenerate < 0:
        fail(f"group counts n_cov={r.n_cov}, n_risk={r.n_risk}, n_degenerate={r.n_degenerate} out of range")
    m = len(r.tau_grid)
    if m == 0 or any(len(getattr(r, k)) != m for k in ("n_accepted", "n_reversals", "ucb", "utility")):
        fail("tau_grid, n_accepted, n_reversals, ucb and utility must be non-empty and of equal length")
    if any(b <= a for a, b in zip(r.tau_grid, r.tau_grid[1:])) or not all(-1 < t < 1 for t in r.tau_grid):
        fail("tau_grid must be strictly increasing inside (-1, 1)")
    if any(not (0 <= f <= n <= r.n_risk) for f, n in zip(r.n_reversals, r.n_accepted)):
        fail("need 0 <= n_reversals <= n_accepted <= n_risk at every threshold")
    ucb, index = select_threshold(r.n_accepted, r.n_reversals, r.utility, beta=r.beta, delta=r.delta)
    if not np.allclose(ucb, r.ucb, rtol=1e-9, atol=1e-12):
        fail("ucb values are not the Clopper-Pearson bounds of (n_reversals, n_accepted) at 1 - delta/m")
    if r.ablation is not None and r.ablation not in ABLATIONS:
        fail(f"ablation={r.ablation!r} is not one of {ABLATIONS}")
    if r.on_infeasible not in ON_INFEASIBLE:
        fail(f"on_infeasible={r.on_infeasible!r} must be one of {ON_INFEASIBLE}")
    if any(not isinstance(p, dict) or set(p) != set(_PROMPT_KEYS) or not all(isinstance(p[k], str) for k in p)
           for p in r.calibration_prompts):
        fail(f"calibration_prompts must be {{{', '.join(_PROMPT_KEYS)}}} string mappings (prompt_fingerprint)")
    if r.tau_sel is not None and r.tau_sel not in r.tau_grid:
        fail(f"tau_sel={r.tau_sel} is not on tau_grid")
    if r.ablation == "fixed_threshold":
        if r.tau_sel is None:
            fail("a fixed_threshold record needs tau_sel")
    elif index is None:
        if r.tau_sel is not None or r.on_infeasible != "reject_all":
            fail("no threshold is risk-feasible, so tau_sel must be None with on_infeasible='reject_all'")
    elif r.tau_sel != r.tau_grid[index]:
        fail(f"tau_sel={r.tau_sel} is not the SRGO selection {r.tau_grid[index]} for these counts")
