"""The outcome comparison's analysis (``setgrpo-verl compare``, docs/outcome.md#through-verl-the-plan): held-out truth
reward per arm and seed from each run's verl metrics file, its gain with paired t-bands over seeds, and a figure of
held-out truth reward against steps, training grader calls and wall-clock time.

Pure reading and arithmetic; nothing here runs verl.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from .run import ReportError, load_metrics

__all__ = ["ARM_ORDER", "CALLS_METRIC", "RUN_NAME", "TRUTH_METRIC", "Curve", "check_one_experiment", "check_one_precision",
           "check_one_setting",
           "command_precision", "outcome_line", "outcome_report", "outcome_rows", "outcome_table", "plot_outcome",
           "read_curve", "read_runs", "write_outcome"]

#: verl's validation metric of the held-out truth reward: ``_validate`` logs the mean of each numeric
#: ``reward_extra_info`` key per data source as ``val-aux/<data_source>/<key>/mean@<n>``, and the noisy rules grader's
#: noise-free score is ``truth_score``; one greedy response per prompt (verl's ``val_kwargs.n`` 1) gives ``mean@1``.
TRUTH_METRIC = re.compile(r"^val-aux/(?P<source>.+)/truth_score/mean@1$")
#: Training grader calls of a step, logged by both trainers.
CALLS_METRIC = "setgrpo/grading/calls_per_step"
#: Arms in the order the outcome line names them: the candidate, the baselines, the paper's procedure.
ARM_ORDER = ("setgrpo_reliability", "grpo_mean2", "grpo", "setgrpo_paper")
#: A run's directory name, ``<arm>_s<seed>`` (``compare``'s ``compare/`` and the committed runs alike).
RUN_NAME = re.compile(r"^(?P<arm>[a-z][a-z0-9_]*)_s(?P<seed>[0-9]+)$")
#: The noisy grader's flip probability in a run's ``command.sh`` (``grader={type:noisy,flip_prob:P,...}``).
_FLIP = re.compile(r"[{,]flip_prob:(?P<p>[0-9.eE+-]+)[,}]")
#: The CPU backend's precision in a run's ``command.sh``: the rollout's dtype and the actor's FSDP parameter dtype.
_ROLLOUT_DTYPE = re.compile(r"actor_rollout_ref\.rollout\.dtype=(?P<d>[A-Za-z0-9_]+)")
_PARAM_DTYPE = re.compile(r"actor_rollout_ref\.actor\.fsdp_config\.mixed_precision"
                          r"(?:=\{[^}]*?\bparam_dtype:|\.param_dtype=)(?P<d>[A-Za-z0-9_]+)")
_DTYPE_NAMES = {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32", "float16": "fp16",
                "fp16": "fp16"}
#: What the outcome's truth reward is, as ``outcome.json`` names it.
_METRIC = "held-out truth reward (val-aux/<data_source>/truth_score/mean@1, greedy)"
#: Arms every other arm is compared with, paired over the seeds both have.
_BASELINES = ("grpo", "grpo_mean2")
#: The late window: the validations in the last fifth of the steps. Their mean reads the trained policy with less of
#: one validation's sampling noise than the last validation alone (on 240 held-out prompts, consecutive validations
#: of one run differ by up to about 0.05).
LATE_SHARE = 0.2


@dataclass(frozen=True)
class Curve:
    """One run's held-out truth reward at its validated steps (``steps``: int [V], 0 first, ascending; ``truth``:
    float [V] in [0, 1]) and what had been spent by then: training grader calls (``calls``: float [V]) and
    wall-clock seconds of training steps and validations (``seconds``: float [V], 0 at step 0). ``lost``: the
    training steps whose metrics row a crash took after their checkpoint (a resumed run continues after them), whose
    calls and seconds are the run's median step's."""

    steps: np.ndarray
    truth: np.ndarray
    calls: np.ndarray
    seconds: np.ndarray
    lost: tuple[int, ...] = ()


def read_curve(path: str | os.PathLike) -> Curve:
    """The :class:`Curve` of one run's verl metrics file (``metrics.jsonl``; a step logged twice counts with its
    last row, as after a resume).

    verl logs a step's row after its checkpoint, so a run that crashed between the two and was resumed from that
    checkpoint has trained the step without its row (and without its validation). Such a step, one after which the
    run logged again, is in :attr:`Curve.lost`: its grader calls and seconds are the run's median step's (the
    calls of every step of an arm are the same; the seconds an estimate).

    Raises:
        ReportError: no held-out truth reward (validation off, or a grader without a truth), none before the first
            step, held-out prompts of several data sources, or a training step without its timing or grader calls.
    """
    path = Path(path)
    truth: dict[int, float] = {}
    spent: dict[int, tuple[float, float]] = {}
    for row in load_metrics(path):
        step = int(row.get("training/global_step", -1))
        keys = [k for k in row if TRUTH_METRIC.match(k)]
        if len(keys) > 1:
            raise ReportError(f"{path}: held-out truth reward of several data sources ({', '.join(sorted(keys))}); "
                              "the comparison reads one held-out set")
        if keys:
            truth[step] = float(row[keys[0]])
        if "timing_s/step" in row:
            if row.get(CALLS_METRIC) is None:
                raise ReportError(f"{path}: step {step} has no {CALLS_METRIC}; the comparison's trainers log it")
            spent[step] = (float(row[CALLS_METRIC]), float(row["timing_s/step"]) + float(row.get("timing_s/testing", 0)))
    if not truth:
        raise ReportError(f"{path}: no held-out truth reward (val-aux/<data_source>/truth_score/mean@1): run it with "
                          "held-out validation (trainer.test_freq) and the noisy rules grader, as compare does")
    if 0 not in truth:
        raise ReportError(f"{path}: no held-out truth reward before the first step (trainer.val_before_train)")
    steps = np.array(sorted(truth))
    last = int(steps[-1])
    lost = sorted(set(range(1, last + 1)) - set(spent))
    if lost and (not spent or lost[-1] > max(spent)):
        raise ReportError(f"{path}: training steps {lost[:5]} are missing and no step after them was logged, so "
                          "grader calls and wall-clock time up to the later validations are unknown")
    if lost:
        median = (float(np.median([c for c, _ in spent.values()])), float(np.median([t for _, t in spent.values()])))
        spent = {**spent, **{s: median for s in lost}}
    calls = np.cumsum([0.0] + [spent[s][0] for s in range(1, last + 1)])
    seconds = np.cumsum([0.0] + [spent[s][1] for s in range(1, last + 1)])
    return Curve(steps=steps, truth=np.array([truth[s] for s in steps]), calls=calls[steps], seconds=seconds[steps],
                 lost=tuple(lost))


def _band(x: np.ndarray) -> tuple[float, float]:
    """Mean and the 95 % t half-width over seeds (nan with one seed)."""
    from scipy import stats

    x = np.asarray(x, dtype=float)
    if x.size < 2:
        return float(x.mean()), math.nan
    return float(x.mean()), float(stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))


def _arms(curves: Mapping[str, Mapping[int, Curve]]) -> list[str]:
    return sorted(curves, key=lambda a: (ARM_ORDER.index(a) if a in ARM_ORDER else len(ARM_ORDER), a))


def outcome_rows(curves: Mapping[str, Mapping[int, Curve]]) -> dict:
    """Gain of held-out truth reward from step 0 to the last step every run validated, per arm over the seeds it has,
    and paired with each baseline over the seeds both arms have.

    Args:
        curves: ``{arm: {seed: Curve}}``.

    Returns:
        ``{"seeds": [int] (every seed of any arm), "steps": int, "arms": [{"arm", "seeds", "gain", "band", "gains":
        [per seed], "paired": {baseline: [mean, half_width]}, "paired_seeds": {baseline: [int]}, "late_gain",
        "late_band", "late_paired", "calls_per_step", "seconds_per_step", "start", "end", "lost_steps": {seed:
        [step]}}], "late_from": float}``; ``band`` and the half-widths are 95 % t half-widths over seeds (nan with one
        seed); a baseline that shares no seed with the arm is left out of ``paired``; the ``late_*`` fields are the
        same for the late gain: the mean held-out truth reward over a run's validations at steps ``>= late_from``
        (the last :data:`LATE_SHARE` of the steps) minus its step-0 value; ``lost_steps``: :attr:`Curve.lost` of the
        arm's runs that have any.

    Raises:
        ReportError: no run, or finished runs that validated last at different steps.
    """
    if not any(curves.values()):
        raise ReportError("no finished run to analyse")
    curves = {arm: runs for arm, runs in curves.items() if runs}
    ends = {f"{arm}_s{s}": int(c.steps[-1]) for arm, runs in curves.items() for s, c in runs.items()}
    if len(set(ends.values())) > 1:
        raise ReportError("finished runs validated last at different steps ("
                          + ", ".join(f"{run} {step}" for run, step in sorted(ends.items())) + "); analyse runs of "
                          "the same --steps and --val-every together, or, where the runs that end earlier lost their "
                          "later validations, run `compare --analysis-only` on their run directory, which names the "
                          "fix for each")
    last = next(iter(ends.values()))

    def at(c: Curve, step: int) -> int:
        return int(np.searchsorted(c.steps, step, side="right")) - 1

    late_from = last * (1 - LATE_SHARE)
    gains = {arm: {s: c.truth[at(c, last)] - c.truth[0] for s, c in runs.items()} for arm, runs in curves.items()}
    lates = {arm: {s: float(c.truth[(c.steps >= late_from) & (c.steps <= last)].mean() - c.truth[0])
                   for s, c in runs.items()} for arm, runs in curves.items()}

    rows = []
    for arm in _arms(curves):
        seeds = sorted(curves[arm])
        runs = [curves[arm][s] for s in seeds]
        gain, band = _band(np.array([gains[arm][s] for s in seeds]))
        late_gain, late_band = _band(np.array([lates[arm][s] for s in seeds]))
        # each baseline that shares a seed with this arm, and the seeds they share
        shared = {b: sorted(set(curves[arm]) & set(curves[b])) for b in _BASELINES if b in curves and b != arm}
        shared = {b: common for b, common in shared.items() if common}

        def paired(by_seed: Mapping[str, Mapping[int, float]]) -> dict[str, list[float]]:
            return {b: list(_band(np.array([by_seed[arm][s] - by_seed[b][s] for s in common])))
                    for b, common in shared.items()}

        rows.append({
            "arm": arm, "seeds": seeds, "gain": gain, "band": band, "gains": [float(gains[arm][s]) for s in seeds],
            "paired": paired(gains), "paired_seeds": shared,
            "late_gain": late_gain, "late_band": late_band, "late_paired": paired(lates),
            "start": float(np.mean([c.truth[0] for c in runs])),
            "end": float(np.mean([c.truth[at(c, last)] for c in runs])),
            "calls_per_step": float(np.mean([c.calls[at(c, last)] / last for c in runs])) if last else math.nan,
            "seconds_per_step": float(np.mean([c.seconds[at(c, last)] / last for c in runs])) if last else math.nan,
            "lost_steps": {str(s): list(curves[arm][s].lost) for s in seeds if curves[arm][s].lost},
        })
    return {"seeds": sorted(set().union(*(set(runs) for runs in curves.values()))), "steps": last, "arms": rows,
            "late_from": late_from}


def _interval(mean: float, half: float) -> str:
    return "[n/a: one seed]" if math.isnan(half) else f"[{mean - half:.3f}, {mean + half:.3f}]"


def outcome_line(result: Mapping) -> str:
    """``outcome: <arm> <gain> [<lo>, <hi>], ... (held-out truth reward gain, S seeds, N steps)``; arms with different
    numbers of seeds give them in the arms' order (``2, 2 and 1 seeds``)."""
    arms = ", ".join(f"{r['arm']} {r['gain']:.3f} {_interval(r['gain'], r['band'])}" for r in result["arms"])
    counts = [len(r["seeds"]) for r in result["arms"]]
    if len(set(counts)) == 1:
        seeds = f"{counts[0]} seed{'s' * (counts[0] != 1)}"
    else:
        seeds = f"{', '.join(map(str, counts[:-1]))} and {counts[-1]} seeds"
    return f"outcome: {arms} (held-out truth reward gain, {seeds}, {result['steps']} steps)"


def outcome_table(result: Mapping) -> str:
    """A text table of :func:`outcome_rows`: seeds, start and end truth reward, gain and band, the paired differences
    with the baselines (over the seeds both arms have), training grader calls and wall-clock seconds per step; then
    the same gains over the late window."""
    lines = [f"{'arm':<20} {'seeds':>5} {'start':>6} {'end':>6} {'gain':>7} {'95% band':>18} {'- grpo':>24} "
             f"{'- grpo_mean2':>24} {'calls/step':>10} {'s/step':>7}"]
    for r in result["arms"]:
        paired = [f"{r['paired'][b][0]:+.3f} {_interval(*r['paired'][b])}" if b in r["paired"] else "-"
                  for b in _BASELINES]
        lines.append(f"{r['arm']:<20} {len(r['seeds']):>5} {r['start']:>6.3f} {r['end']:>6.3f} {r['gain']:>+7.3f} "
                     f"{_interval(r['gain'], r['band']):>18} {paired[0]:>24} {paired[1]:>24} "
                     f"{r['calls_per_step']:>10.1f} {r['seconds_per_step']:>7.1f}")
    lines.append("paired differences: over the seeds both arms have")
    lines.append(f"late window: the mean of each run's validations at steps >= {result['late_from']:g}, minus step 0")
    lines.append(f"{'arm':<20} {'late gain':>14} {'95% band':>18} {'- grpo':>24} {'- grpo_mean2':>24}")
    for r in result["arms"]:
        paired = [f"{r['late_paired'][b][0]:+.3f} {_interval(*r['late_paired'][b])}" if b in r["late_paired"] else "-"
                  for b in _BASELINES]
        lines.append(f"{r['arm']:<20} {r['late_gain']:>+14.3f} {_interval(r['late_gain'], r['late_band']):>18} "
                     f"{paired[0]:>24} {paired[1]:>24}")
    return "\n".join(lines)


def command_precision(command: str) -> str | None:
    """The compute precision a verl command line sets (a run's ``command.sh``; docs/outcome.md#through-verl-the-plan):
    ``"bf16"`` or ``"fp32"`` where the rollout's dtype (``actor_rollout_ref.rollout.dtype``) and the actor's FSDP
    parameter dtype (``actor.fsdp_config.mixed_precision.param_dtype``) agree, ``"rollout <d>, actor <d>"`` where
    they differ or only one is set, None where the command sets neither (verl's defaults: a GPU recipe's precision).
    The precision changes every sampled token and gradient, so runs at different precisions are different
    experiments, like runs at different flip probabilities."""
    # the last setting wins, as in Hydra (a user's override follows the launcher's)
    rollout, actor = (ds[-1] if (ds := rx.findall(command)) else None for rx in (_ROLLOUT_DTYPE, _PARAM_DTYPE))
    rollout, actor = (_DTYPE_NAMES.get(d, d) if d else None for d in (rollout, actor))
    if rollout is None and actor is None:
        return None
    return rollout if rollout == actor else f"rollout {rollout or 'default'}, actor {actor or 'default'}"


def check_one_setting(values: Mapping[str, object], what: str, where: str, *,
                      show: Callable[[object], str] = str, why: str = "") -> None:
    """Refuse runs of one analysis that differ in a setting that makes them different experiments: one comparison
    is one grader (``flip probabilities``) and one arithmetic (``precisions``, :func:`command_precision`).

    Args:
        values: ``{run name: the run's value}``; compared as they are, shown with ``show``.
        what: the setting's name in the plural, as the message says it.
        where: the run directory or analysis the message names first.
        why: the reason, before ``analyse each apart``.

    Raises:
        ReportError: ``values`` hold more than one value; names each run's.
    """
    if len(set(values.values())) > 1:
        raise ReportError(f"{where}: runs at different {what} ("
                          + ", ".join(f"{r} {show(v)}" for r, v in sorted(values.items()))
                          + f"); {why}analyse each apart")


def check_one_precision(precisions: Mapping[str, str | None], where: str) -> None:
    """:func:`check_one_setting` for ``{run name: command_precision(...)}`` (``verl default`` for None)."""
    check_one_setting(precisions, "precisions", where, show=lambda p: p or "verl default",
                      why="a precision changes every sampled token and gradient, so ")


def read_runs(root: str | os.PathLike) -> tuple[dict[str, dict[int, Curve]], float, list[str]]:
    """Every run under ``root`` (a directory ``<arm>_s<seed>`` with verl's ``metrics.jsonl`` and the ``command.sh``
    that ran it; :data:`RUN_NAME`) as ``({arm: {seed: Curve}}, flip_prob, unfinished)``: the committed runs of
    ``validation/outcome_verl/flip<P>/``, or a ``compare`` run directory's ``compare/``, whose runs carry a
    ``COMPLETE`` marker once finished: where any run has one or has verl's log ``main_ppo.log`` (the layout
    ``compare`` writes), the runs without the marker are left out and named in ``unfinished`` (``<arm>_s<seed>``),
    as ``compare --analysis-only`` does; where none has either (the committed layout), every run counts as
    finished.

    Raises:
        ReportError: ``root`` is not a directory or holds no run, a run's metrics are missing or refused
            (:func:`read_curve`), a ``command.sh`` is missing or names no noisy grader's ``flip_prob``, or the runs
            are at different flip probabilities or precisions (:func:`command_precision`; one comparison is one
            grader and one arithmetic).
    """
    from ..rundir import COMPLETE

    root = Path(root)
    if not root.is_dir():
        raise ReportError(f"{root}: no such directory (give the directory that holds the <arm>_s<seed> runs)")
    runs = sorted(p for p in root.iterdir() if p.is_dir() and RUN_NAME.match(p.name))
    if not runs:
        raise ReportError(f"{root}: no run directory <arm>_s<seed> in it")
    marked = any((run / COMPLETE).is_file() or (run / "main_ppo.log").is_file() for run in runs)
    unfinished = [run.name for run in runs if marked and not (run / COMPLETE).is_file()]
    curves: dict[str, dict[int, Curve]] = {}
    commands: dict[str, str] = {}
    for run in (run for run in runs if run.name not in unfinished):
        name = RUN_NAME.match(run.name)
        try:
            commands[run.name] = (run / "command.sh").read_text()
            curve = read_curve(run / "metrics.jsonl")
        except ReportError:
            raise
        except (OSError, ValueError) as exc:  # a missing file, or a metrics row that is not JSON
            raise ReportError(f"{run}: {exc}") from None
        curves.setdefault(name["arm"], {})[int(name["seed"])] = curve
    if not curves:
        raise ReportError(f"{root}: no finished run (none of {', '.join(unfinished)} has its {COMPLETE} marker)")
    return curves, check_one_experiment(commands, str(root)), unfinished


def check_one_experiment(commands: Mapping[str, str], where: str) -> float:
    """The flip probability of the runs of one analysis (``compare``'s and ``report --outcome``'s), after refusing
    runs that are not one experiment: another grader noise (:func:`check_one_setting`), another precision
    (:func:`check_one_precision`), or any other setting that changes a response, a grade or a gradient
    (:func:`~setgrpo_verl.report.experiment.check_same_experiment`).

    Args:
        commands: ``{run name: the run's command.sh text}``, at least one.
        where: the run directory or analysis the messages name first.

    Raises:
        ReportError: a command without a noisy grader's ``flip_prob``, or runs that differ (naming the setting and
            each run's value).
    """
    from .experiment import check_same_experiment

    flips: dict[str, float] = {}
    for run, command in commands.items():
        flip = _FLIP.search(command)
        if flip is None:
            raise ReportError(f"{where}: {run}'s command.sh names no noisy grader's flip_prob; the comparison's runs "
                              "use one")
        flips[run] = float(flip["p"])
    check_one_setting(flips, "flip probabilities", where, show=lambda p: f"{p:g}")
    check_one_precision({run: command_precision(c) for run, c in commands.items()}, where)
    check_same_experiment(commands, where)
    return next(iter(flips.values()))


def outcome_report(curves: Mapping[str, Mapping[int, Curve]], *, flip_prob: float,
                   unfinished: list[str] | tuple[str, ...] = ()) -> tuple[dict, str]:
    """The analysis as ``outcome.json`` and ``outcome.txt`` hold it: :func:`outcome_rows` with ``flip_prob``, the
    ``unfinished`` runs left out and the metric's name; the text is :func:`outcome_table`, the runs left out, the
    steps trained without a metrics row, then :func:`outcome_line` (last).

    Raises:
        ReportError: as :func:`outcome_rows`.
    """
    result = {**outcome_rows(curves), "flip_prob": flip_prob, "unfinished": list(unfinished), "metric": _METRIC}
    text = outcome_table(result)
    if unfinished:
        text += f"\nnot finished, left out: {', '.join(unfinished)}"
    lost = [f"{r['arm']}_s{seed} {steps}" for r in result["arms"] for seed, steps in r["lost_steps"].items()]
    if lost:
        text += ("\nsteps trained without a metrics row (a crash after their checkpoint; calls and seconds set to the "
                 f"run's median step): {', '.join(lost)}")
    return result, text + "\n" + outcome_line(result)


def write_outcome(out: str | os.PathLike, curves: Mapping[str, Mapping[int, Curve]], result: Mapping, text: str,
                  figure: str | os.PathLike | None = None) -> Path:
    """Write :func:`outcome_report`'s ``result`` and ``text`` as ``out/outcome.json`` and ``out/outcome.txt``, after
    the figure (:func:`plot_outcome`; ``figure``, default ``out/outcome.png``), so that runs it cannot draw leave no
    outcome files. Returns ``out/outcome.json``.

    Raises:
        ReportError: as :func:`plot_outcome`.
    """
    import json

    from ..atomic import write_atomic

    out = Path(out)
    plot_outcome(curves, out / "outcome.png" if figure is None else figure)
    write_atomic(out / "outcome.json", json.dumps(result, indent=1) + "\n")
    write_atomic(out / "outcome.txt", text + "\n")
    return out / "outcome.json"


def plot_outcome(curves: Mapping[str, Mapping[int, Curve]], path: str | os.PathLike) -> Path:
    """PNG of held-out truth reward (each arm's mean over its seeds with its 95 % t-band) against steps, training
    grader calls and wall-clock hours, one line per arm, its seeds in the legend; the x values of calls and hours are
    the seeds' means at each validation; the y axis spans the means with 0.1 to spare (bands beyond it are cut). An
    arm's points are the steps every run of it validated (a validation lost to a crash, :attr:`Curve.lost`, drops
    that step from the arm's line).

    Raises:
        ReportError: no run, or the runs of an arm share fewer than two validated steps.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..atomic import atomic_file

    drawn = _arms({arm: runs for arm, runs in curves.items() if runs})
    if not drawn:
        raise ReportError("no run to draw")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    try:
        _draw(fig, axes, curves, drawn)
        path = Path(path)
        with atomic_file(path) as fh:
            fig.savefig(fh, format="png", dpi=110)
    finally:
        plt.close(fig)
    return path


def _draw(fig, axes, curves: Mapping[str, Mapping[int, Curve]], arms: list[str]) -> None:
    """Draw :func:`plot_outcome`'s three panels for ``arms`` (each with at least one run) on ``axes``."""
    means = []
    for arm in arms:
        runs = [curves[arm][s] for s in sorted(curves[arm])]
        steps = np.array(sorted(set.intersection(*(set(c.steps.tolist()) for c in runs))))
        if steps.size < 2:
            raise ReportError(f"the {arm} runs share fewer than two validated steps; rerun them with the same "
                              "--val-every")
        picks = [np.searchsorted(c.steps, steps) for c in runs]
        truth = np.stack([c.truth[i] for c, i in zip(runs, picks)])
        bands = np.array([_band(truth[:, j])[1] for j in range(truth.shape[1])])
        mean = truth.mean(axis=0)
        means.append(mean)
        xs = (steps, np.mean([c.calls[i] for c, i in zip(runs, picks)], axis=0),
              np.mean([c.seconds[i] for c, i in zip(runs, picks)], axis=0) / 3600)
        for ax, x in zip(axes, xs):
            line, = ax.plot(x, mean, marker="o", ms=3, label=f"{arm} ({len(runs)} seed{'s' * (len(runs) != 1)})")
            if not np.isnan(bands).all():
                ax.fill_between(x, mean - bands, mean + bands, color=line.get_color(), alpha=0.15)
    for ax, label in zip(axes, ("training step", "training grader calls", "wall-clock hours (steps + validations)")):
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out truth reward")
    # the means set the scale: a band over two seeds (t quantile 12.7) would flatten every line, so it is cut there
    low, high = float(np.min(np.concatenate(means))), float(np.max(np.concatenate(means)))
    axes[0].set_ylim(max(0.0, low - 0.1), min(1.0, high + 0.1))
    axes[0].legend()
    fig.suptitle("held-out truth reward, mean and 95% t-band over each arm's seeds")
    fig.tight_layout()
