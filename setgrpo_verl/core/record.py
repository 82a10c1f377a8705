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

from ..atomic import atomic_file
from .grpo import DEGENERATE_RTOL
from .settings import COVERAGE_GROUPS, CalibrationSettings
from .srgo import threshold_tests

#: Version 2 added ``degenerate_rtol`` (the degeneracy tolerance that calibration used and training applies);
#: version 3 added ``calibration_prompts`` (what the record was calibrated on); version 4 the SRGO testing procedure
#: (``srgo_procedure``, ``tau_start`` and where it came from, the test order, levels, p-values and the stop);
#: version 5 nests the settings the record was calibrated with as ``settings`` (a ``CalibrationSettings`` dict, with
#: the split shares, ``fixed_tau`` and ``variant`` that the flat fields of versions 3 and 4 left out); version 6 adds
#: ``training`` and the policy's content identity (:data:`~._identity.IDENTITY_SINCE_6`).
SCHEMA_VERSION = 6
#: Older schemas that are still read, migrated on reading (:func:`_migrate`): a version-3 record is a Bonferroni
#: record, its tests re-derived; versions 3 and 4 have flat settings fields; version 5 has no ``training``.
_READABLE_OLD = (3, 4, 5)
#: The flat settings fields of schemas 3 and 4, now ``settings``' fields of the same names.
_FLAT_SETTINGS = ("alpha", "beta", "delta", "rho", "tau_grid", "norm_by_std", "eps", "grid_size", "ablation",
                  "on_infeasible", "srgo_procedure", "tau_start")
_TEST_FIELDS = ("test_order", "test_levels", "p_values", "stopped_at")
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


def differing_versions(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The packages (setgrpo-verl, verl) whose major.minor differs between two :func:`package_versions` dicts; a
    package missing from either is not compared."""
    return [name for name in _VERSIONED
            if name in ours and name in theirs and _major_minor(ours[name]) != _major_minor(theirs[name])]


def question_key(question: str) -> str:
    """A question's text as prompts are compared: whitespace runs collapsed to one space, case folded."""
    return " ".join(str(question).split()).casefold()


def question_sha256(question: str) -> str:
    """SHA-256 hex digest of a question after :func:`question_key`: how a record names a calibration question."""
    return _sha256(question_key(question))


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
    return {"id": str(prompt_id), "question_sha256": question_sha256(question), "rubric_sha256": _sha256(body)}


@dataclass(frozen=True)
class CalibrationRecord:
    """Frozen result of JRSC + SRGO calibration; apply it with ``setgrpo_coefficients``.

    Guarantees (exchangeability of calibration groups and training groups, same grader protocol
    and policy): ``P(T(r'_new) in C_new) >= 1 - alpha`` (coverage of the coefficient set with
    radius ``q_alpha``) and, with probability >= ``1 - delta`` over the risk-calibration groups,
    the conditional direction-reversal risk of accepted groups at ``tau_sel`` is <= ``beta``.

    Per-threshold arrays (length m, aligned with ``settings.tau_grid``): ``n_accepted`` N_j,
    ``n_reversals`` F_j, ``ucb`` (Clopper-Pearson at ``1 - delta/m``), ``utility`` U_j.
    ``degenerate_rtol`` is the relative tolerance of the degeneracy test (docs/algorithm.md#1-grpo-map,
    :func:`setgrpo_verl.core.grpo.degenerate_groups`) used to leave groups out of calibration; training
    applies the same value, so a group's status never changes between the phases.
    ``tau_sel`` is None only when calibration found no risk-feasible threshold and the user chose
    ``on_infeasible="reject_all"``: such a record rejects every group.
    ``settings`` is the :class:`~setgrpo_verl.core.CalibrationSettings` the record was calibrated with (levels,
    grid, ridge, coefficient map, ablation, procedure, split shares, variant); everything else is a result of the
    calibration or describes the run it was made for.
    ``policy`` (what samples the responses: weights and tokenizer by content, chat template, sampling, rollout
    dtype) and ``training`` (what the gradients are of: LoRA, compute precision) identify the run with ``grader``,
    ``sketch`` and ``loss_agg_mode`` (docs/record.md#run-identity); ``policy.model`` is the configured path, never
    compared.
    ``calibration_prompts`` names what the record was calibrated on: one :func:`prompt_fingerprint`
    (id, question hash, rubric hash) per calibration prompt, empty when the caller gave none;
    :func:`~setgrpo_verl.core.compatibility.check_disjoint` refuses training prompts among them.

    SRGO's tests (docs/algorithm.md#4-srgo): ``settings.srgo_procedure`` (``bonferroni`` or ``fixed_sequence``),
    ``settings.tau_start`` (the fixed sequence's first threshold, None for Bonferroni) and ``tau_start_source``
    (where it came from: ``{"kind": "user"}`` or ``{"kind": "pilot", "record_sha256": <pilot record's content hash>}``);
    ``test_order`` (grid indices in the order tested), ``test_levels`` (the level of each of those tests),
    ``p_values`` (``[m]``, ``P(Bin(N_j, beta) <= F_j)``) and ``stopped_at`` (the grid index of the failed test that
    ended a fixed sequence, None otherwise). Left empty on construction they are derived from the counts; given,
    they must equal that derivation.

    The paper's Table 4 columns are the properties ``N``, ``F``, ``ecr`` and ``U`` together with
    ``n_cov``, ``n_risk``, ``q_alpha`` and ``tau_sel`` (see :func:`~setgrpo_verl.core.record_text.table4_row`).
    """

    settings: CalibrationSettings
    q_alpha: float
    n_cov: int
    n_risk: int
    n_degenerate: int
    n_accepted: tuple[int, ...]
    n_reversals: tuple[int, ...]
    ucb: tuple[float, ...]
    utility: tuple[float, ...]
    tau_sel: float | None
    K: int
    coverage_risk_set: float
    split_seed: int = 0
    loss_agg_mode: str = "token-mean"
    sketch: dict = field(default_factory=dict)
    grader: dict = field(default_factory=dict)
    policy: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    package_versions: dict = field(default_factory=dict)
    created_at: str = ""
    degenerate_rtol: float = DEGENERATE_RTOL
    calibration_prompts: tuple = ()
    tau_start_source: dict = field(default_factory=dict)
    test_order: tuple = ()
    test_levels: tuple = ()
    p_values: tuple = ()
    stopped_at: int | None = None
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.settings, CalibrationSettings):
            raise ValueError(f"invalid calibration record: settings must be a CalibrationSettings, got "
                             f"{type(self.settings).__name__} (read a stored dict with CalibrationSettings.from_dict)")
        if not self.test_order and not self.test_levels and not self.p_values:
            tests = _tests(self)
            if tests is not None:
                for name, value in _test_fields(tests).items():
                    object.__setattr__(self, name, value)
        _validate(self)

    @property
    def start_index(self) -> int | None:
        """Grid index of ``settings.tau_start`` (None for Bonferroni)."""
        s = self.settings
        return None if s.tau_start is None else s.tau_grid.index(s.tau_start)

    # ----------------------------------------------------------------- Table 4 view
    @property
    def sel_index(self) -> int | None:
        """Index of ``tau_sel`` in ``settings.tau_grid`` (None for a reject-all record)."""
        return None if self.tau_sel is None else self.settings.tau_grid.index(self.tau_sel)

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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: all fields, the Table 4 summary, and a content hash."""
        d = dataclasses.asdict(self)
        d["summary"] = {"N": self.N, "F": self.F, "ecr": None if math.isnan(self.ecr) else self.ecr,
                        "U": self.U, "ucb_sel": self.ucb_sel}
        d[_HASH_KEY] = _content_hash(d)
        return d

    def to_json(self, path: str | os.PathLike) -> None:
        """Write the record as indented JSON, whole or not at all (:func:`setgrpo_verl.atomic.atomic_file`)."""
        with atomic_file(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=2, ensure_ascii=False)
            fh.write("\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CalibrationRecord:
        """Rebuild and validate a record from :meth:`to_dict` output.

        Warns:
            RecordVersionWarning: the record comes from another major.minor of setgrpo-verl or verl
                (:func:`version_mismatch`).

        Raises:
            ValueError: unknown schema version, missing/unknown fields, a content hash that does not
                match (the file was edited), or values that violate the record's invariants.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a calibration record is a JSON object, got a JSON {type(data).__name__}")
        data = dict(data)
        version = data.get("schema_version")
        if version != SCHEMA_VERSION and version not in _READABLE_OLD:
            raise ValueError(
                f"calibration record schema_version is {version!r}, this package reads {SCHEMA_VERSION} (and "
                f"{', '.join(map(str, _READABLE_OLD))}, migrated on reading); recalibrate with this version"
            )
        stored = data.pop(_HASH_KEY, None)
        if stored is None or stored != _content_hash({**data}):
            raise ValueError(
                "calibration record content hash does not match: the file was modified after calibration "
                "(or is truncated); a frozen record must not be edited - recalibrate instead"
            )
        summary = data.pop("summary", None)
        if version != SCHEMA_VERSION:
            data = _migrate(data)
        names = {f.name for f in dataclasses.fields(cls)}
        missing, unknown = names - set(data), set(data) - names
        if missing or unknown:
            raise ValueError(f"calibration record fields wrong: missing {sorted(missing)}, unknown {sorted(unknown)}")
        try:
            data["settings"] = CalibrationSettings.from_dict(data["settings"])
        except ValueError as exc:
            raise ValueError(f"invalid calibration record: settings: {exc}") from None
        for key in ("n_accepted", "n_reversals", "ucb", "utility", "calibration_prompts", "test_order",
                    "test_levels", "p_values"):
            data[key] = tuple(data[key])
        record = cls(**data)
        # the hash the file was written with: what resume state and pilot sources name the record by, also when
        # an older schema was migrated (whose content, and so hash, is written anew by to_dict)
        object.__setattr__(record, "_file_sha256", stored)
        if summary is not None and (summary.get("N"), summary.get("F")) != (record.N, record.F):
            raise ValueError("calibration record summary (N, F) disagrees with its per-threshold counts")
        mismatch = version_mismatch(record)
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


def version_mismatch(record: CalibrationRecord, installed: dict[str, str] | None = None) -> str | None:
    """Why this record comes from another major.minor of setgrpo-verl or verl than ``installed`` (default: the
    installed packages), naming both versions; None when they agree or a version is unknown."""
    installed = package_versions() if installed is None else installed
    diffs = [f"{name} {record.package_versions[name]} (installed {installed[name]})"
             for name in differing_versions(record.package_versions, installed)]
    if not diffs:
        return None
    return (f"calibration record written by {', '.join(diffs)}: its math and run identity are checked, but "
            "the calibration may differ from what this version would compute; recalibrate to be sure")

def _content_hash(d: dict[str, Any]) -> str:
    body = {k: v for k, v in d.items() if k != _HASH_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


def content_sha256(record: CalibrationRecord) -> str:
    """The content hash a record's JSON file stores (``content_sha256``, 64 hex): what a fixed sequence's
    ``tau_start_source`` and a checkpoint's resume state name a record by (docs/record.md#fields).

    For a record read from a file (:meth:`CalibrationRecord.from_dict`) it is the hash that file stores, also for
    an older schema migrated on reading (whose :meth:`~CalibrationRecord.to_dict` hashes the migrated content);
    for a record built in memory, the hash :meth:`~CalibrationRecord.to_json` will write.
    """
    return getattr(record, "_file_sha256", None) or record.to_dict()[_HASH_KEY]


def _migrate(data: dict[str, Any]) -> dict[str, Any]:
    """A schema-3, -4 or -5 record dict (hash and summary removed) as schema 6 (docs/record.md#older-records).

    Schemas 3 and 4: the flat settings fields become ``settings``; what they left out is filled in: ``variant`` is
    ``paper``, ``fixed_tau`` is the ``fixed_threshold`` ablation's ``tau_sel``, and the split shares are the defaults
    (``risk_fraction`` 0.5, ``coverage_groups`` 1,000) when they give the record's coverage/risk counts, else
    ``coverage_groups`` is the record's ``n_cov`` (which does). A schema-3 record is a Bonferroni record.
    Schemas 3 to 5: ``training`` is empty (its keys, and the policy keys of schema 6, are named in a warning when
    the record is checked against a run, :func:`check_identity`).
    """
    data = dict(data)
    if data.get("schema_version") in (3, 4):
        data = _migrate_flat_settings(data)
    data.update(training={}, schema_version=SCHEMA_VERSION)
    return data


def _migrate_flat_settings(data: dict[str, Any]) -> dict[str, Any]:
    """Schema 3 or 4 -> schema 5 (see :func:`_migrate`)."""
    if data.get("schema_version") == 3:  # the paper's Bonferroni procedure; its tests are re-derived from the counts
        data.update(srgo_procedure="bonferroni", tau_start=None, tau_start_source={}, test_order=(),
                    test_levels=(), p_values=(), stopped_at=None)
    missing = [name for name in _FLAT_SETTINGS if name not in data]
    if missing:
        raise ValueError(f"calibration record fields wrong: schema {data.get('schema_version')} needs the settings "
                         f"fields {list(_FLAT_SETTINGS)}, missing {missing}")
    settings = {name: data.pop(name) for name in _FLAT_SETTINGS}
    n_cov, n_risk = data.get("n_cov"), data.get("n_risk")
    cap = COVERAGE_GROUPS
    if isinstance(n_cov, int) and isinstance(n_risk, int):
        n = n_cov + n_risk
        if min(n - int(round(n * 0.5)), COVERAGE_GROUPS) != n_cov:
            cap = max(n_cov, 1)
    fixed = data.get("tau_sel") if settings["ablation"] == "fixed_threshold" else None
    settings.update(fixed_tau=fixed, risk_fraction=0.5, coverage_groups=cap, variant="paper")
    data.update(settings=settings, schema_version=5)
    return data


def pilot_start(pilot: CalibrationRecord, tau_grid, *, calibration_prompts=()) -> tuple[float, dict[str, str]]:
    """The fixed sequence's start from a pilot record calibrated on other prompts (docs/algorithm.md#4-srgo).

    The start is the pilot's selected threshold ``tau_sel``; ``tau_start_source`` names the pilot by its content
    hash. Learn then Test is valid only when the start does not depend on the calibration groups, so the pilot's
    prompts must be disjoint from this calibration's.

    Args:
        pilot: the pilot's frozen record.
        tau_grid: this calibration's thresholds; the start must be one of them.
        calibration_prompts: this calibration's :func:`prompt_fingerprint` list (checked against the pilot's).

    Returns:
        ``(tau_start, {"kind": "pilot", "record_sha256": <pilot content hash>})`` for :func:`calibrate`.

    Raises:
        ValueError: a pilot without a selected threshold, a pilot that lists no calibration prompts (its
            disjointness cannot be checked), a start off ``tau_grid``, or shared prompts (named).
    """
    if pilot.tau_sel is None:
        raise ValueError("the pilot record selected no threshold (reject-all), so it gives no start for the fixed "
                         "sequence; set tau_start yourself or calibrate the pilot on more groups")
    if not pilot.calibration_prompts:
        raise ValueError(f"the pilot record lists no calibration prompts, so nothing shows that they are disjoint "
                         f"from this calibration's: it cannot serve as a pilot; to start from its tau_sel="
                         f"{pilot.tau_sel} anyway, give that as your own start (tau_start={pilot.tau_sel} without "
                         "a pilot; the record then says the start was set by the user, and its certificate assumes "
                         "the start was fixed before the calibration data were seen)")
    grid = [float(t) for t in tau_grid]
    if float(pilot.tau_sel) not in grid:
        raise ValueError(f"the pilot record's tau_sel={pilot.tau_sel} is not on this calibration's tau_grid {grid}")
    mine = {p["id"] for p in pilot.calibration_prompts} | {p["question_sha256"] for p in pilot.calibration_prompts}
    shared = [p["id"] for p in calibration_prompts if p["id"] in mine or p["question_sha256"] in mine]
    if shared:
        raise ValueError(f"{len(shared)} calibration prompt(s) were also the pilot's, the first {shared[0]!r}: a start "
                         "chosen on the calibration data invalidates the fixed sequence's guarantee; calibrate the "
                         "pilot on disjoint prompts")
    return float(pilot.tau_sel), {"kind": "pilot", "record_sha256": content_sha256(pilot)}


def _tests(r: CalibrationRecord) -> Any:
    """SRGO's tests re-derived from a record's counts, or None when its fields cannot say (left to _validate)."""
    s = r.settings
    m = len(s.tau_grid)
    if any(len(getattr(r, k)) != m for k in ("n_accepted", "n_reversals", "utility")):
        return None
    try:
        return threshold_tests(r.n_accepted, r.n_reversals, r.utility, beta=s.beta, delta=s.delta,
                               procedure=s.srgo_procedure, start_index=r.start_index)
    except ValueError:
        return None


def _test_fields(tests: Any) -> dict[str, Any]:
    return {"test_order": tuple(int(j) for j in tests.order), "test_levels": tuple(float(x) for x in tests.levels),
            "p_values": tuple(float(x) for x in tests.p_values), "stopped_at": tests.stopped_at}


def _validate(r: CalibrationRecord) -> None:
    """The record's own invariants; its settings validated themselves (:class:`CalibrationSettings`)."""
    def fail(msg: str) -> None:
        raise ValueError(f"invalid calibration record: {msg}")

    s = r.settings
    if not (r.q_alpha >= 0 and math.isfinite(r.q_alpha)):
        fail(f"q_alpha={r.q_alpha} must be finite and >= 0")
    if r.K < 2:
        fail(f"K={r.K} must be >= 2")
    if isinstance(r.degenerate_rtol, bool) or not isinstance(r.degenerate_rtol, (int, float)) or not (
            0.0 <= r.degenerate_rtol < 1.0):
        fail(f"degenerate_rtol={r.degenerate_rtol!r} must be a number in [0, 1)")
    if r.n_cov < 1 or r.n_risk < 1 or r.n_degenerate < 0:
        fail(f"group counts n_cov={r.n_cov}, n_risk={r.n_risk}, n_degenerate={r.n_degenerate} out of range")
    m = len(s.tau_grid)
    if any(len(getattr(r, k)) != m for k in ("n_accepted", "n_reversals", "ucb", "utility")):
        fail("n_accepted, n_reversals, ucb and utility must each have one entry per threshold of settings.tau_grid")
    if any(not (0 <= f <= n <= r.n_risk) for f, n in zip(r.n_reversals, r.n_accepted)):
        fail("need 0 <= n_reversals <= n_accepted <= n_risk at every threshold")
    source = r.tau_start_source
    if s.srgo_procedure == "bonferroni":
        if source:
            fail("a bonferroni record has no tau_start_source")
    elif not (source == {"kind": "user"} or (isinstance(source, dict) and set(source) == {"kind", "record_sha256"}
                                              and source["kind"] == "pilot"
                                              and isinstance(source["record_sha256"], str)
                                              and len(source["record_sha256"]) == 64)):
        fail(f"tau_start_source={source!r} must be {{'kind': 'user'}} or {{'kind': 'pilot', 'record_sha256': "
             "<the pilot record's 64-hex content hash>}")
    tests = _tests(r)
    if tests is None:
        fail("the SRGO tests cannot be derived from these counts")
    ucb, index = tests.ucb, tests.index
    if not np.allclose(ucb, r.ucb, rtol=1e-9, atol=1e-12):
        fail("ucb values are not the Clopper-Pearson bounds of (n_reversals, n_accepted) at 1 - delta/m "
             "(bonferroni) or 1 - delta (fixed_sequence)")
    derived = _test_fields(tests)
    for name in _TEST_FIELDS:
        mine, want = getattr(r, name), derived[name]
        same = (np.allclose(mine, want, rtol=1e-9, atol=1e-15) if name in ("test_levels", "p_values")
                and len(mine) == len(want) else tuple(mine) == tuple(want) if name != "stopped_at" else mine == want)
        if not same:
            fail(f"{name}={mine!r} is not what the {s.srgo_procedure} tests of these counts give ({want!r})")
    if any(not isinstance(p, dict) or set(p) != set(_PROMPT_KEYS) or not all(isinstance(p[k], str) for k in p)
           for p in r.calibration_prompts):
        fail(f"calibration_prompts must be {{{', '.join(_PROMPT_KEYS)}}} string mappings (prompt_fingerprint)")
    if r.tau_sel is not None and r.tau_sel not in s.tau_grid:
        fail(f"tau_sel={r.tau_sel} is not on settings.tau_grid")
    if s.ablation == "fixed_threshold":
        if r.tau_sel != s.fixed_tau:
            fail(f"a fixed_threshold record's tau_sel={r.tau_sel} must be its settings.fixed_tau={s.fixed_tau}")
    elif index is None:
        if r.tau_sel is not None or s.on_infeasible != "reject_all":
            fail("no threshold is risk-feasible, so tau_sel must be None with on_infeasible='reject_all'")
    elif r.tau_sel != s.tau_grid[index]:
        fail(f"tau_sel={r.tau_sel} is not the SRGO selection {s.tau_grid[index]} for these counts")
