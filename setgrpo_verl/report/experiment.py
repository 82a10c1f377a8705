"""What makes runs one experiment (docs/outcome.md#through-verl-the-plan): the settings of a run's verl command line
(its ``command.sh``) that change a sampled response, a grade or a gradient.

One notion, used in two places: the runs one analysis reads (``compare``'s analysis and ``report --outcome``,
:func:`check_same_experiment`) are one experiment when their settings agree apart from what an arm or a seed is,
and a run that ``compare`` keeps, continues or leaves untouched was made with the command ``compare`` would run for
it now when their settings agree apart from what a resume changes (:func:`differing_settings`).

Pure text handling; nothing here runs verl.
"""

from __future__ import annotations

import re
import shlex
from pathlib import PurePosixPath
from typing import Mapping

from .run import ReportError

__all__ = ["ARM_KEYS", "RESUME_KEYS", "SEED_KEYS", "check_same_experiment", "command_settings", "differing_settings",
           "experiment_settings"]

#: The overrides a resume changes (validating before the first step is a fresh run's, or a resumed run's that owes
#: the validation of its checkpoint's step), which part of a sharded calibration a command made (the record is
#: the whole shard set's), and where this package's pre-Ray check lives (a module path, not a setting: it moved).
RESUME_KEYS = frozenset({"trainer.val_before_train", "algorithm.setgrpo.calibration.shard",
                         "hydra.callbacks.setgrpo_check._target_"})
#: The overrides in which the runs of one experiment differ by seed and name: where a run writes, its name, its seed.
SEED_KEYS = frozenset({"trainer.default_local_dir", "trainer.experiment_name", "hydra.run.dir", "data.seed",
                       "actor_rollout_ref.rollout.seed", "algorithm.setgrpo.group_log"})
#: The overrides that make an arm (``compare``'s arms): verl's config and trainer, the estimator, the reward's scorings
#: and how they are combined, GRPO's dataset class and check, and SetGRPO's own block (``algorithm.setgrpo.*``).
ARM_KEYS = frozenset({"--config-name", "algorithm.adv_estimator", "trainer.v1.trainer_mode",
                      "reward.reward_kwargs.scorings", "reward.reward_kwargs.point", "data.custom_cls.path",
                      "data.custom_cls.name", "hydra.callbacks.setgrpo_check._target_"})
_ARM_PREFIX = "algorithm.setgrpo."
#: The grader's override; its ``seed`` (and its base grader's) is the run's seed.
_GRADER = "reward.reward_kwargs.grader"
_SEED = re.compile(r"([{,])seed:[0-9]+(?=[,}])")
#: Where the run directory's paths start in a value: a run's ``trainer.default_local_dir`` is
#: ``<run-dir>/<stage>/checkpoints`` or ``<run-dir>/compare/<arm>_s<seed>/checkpoints``.
_RUN_DIR = "<run-dir>"


def command_settings(command: str) -> dict[str, str]:
    """The Hydra settings of a verl command line (a run's ``command.sh``, or a command joined by spaces) as
    ``{key: value}``: the overrides after ``verl.trainer.main_ppo`` with Hydra's ``+`` / ``++`` removed from the keys
    (the last one of a key wins, as in Hydra), ``--config-name`` among them, and the run directory in every value
    written as ``<run-dir>`` (so a run directory that was moved keeps its settings).

    Raises:
        ReportError: the text is not a verl ``main_ppo`` command line (no ``verl.trainer.main_ppo``, or quotes that
            do not close).
    """
    text = "\n".join(line for line in command.splitlines() if not line.startswith("#!"))
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ReportError(f"not a command line ({exc})") from None
    if "verl.trainer.main_ppo" not in words:
        raise ReportError("not a verl main_ppo command line (no verl.trainer.main_ppo in it)")
    words = words[words.index("verl.trainer.main_ppo") + 1:]
    settings: dict[str, str] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("--"):
            flag, eq, value = word.partition("=")
            if not eq and i + 1 < len(words):
                value, i = words[i + 1], i + 1
            settings[flag] = value
        else:
            key, _, value = word.partition("=")
            settings[key.lstrip("+")] = value
        i += 1
    local = settings.get("trainer.default_local_dir")
    if local:
        root = PurePosixPath(local).parent.parent
        root = root.parent if root.name == "compare" else root
        if str(root) not in ("/", "."):
            settings = {k: v.replace(str(root) + "/", _RUN_DIR + "/") for k, v in settings.items()}
    return settings


def experiment_settings(command: str, *, across_arms: bool = True) -> dict[str, str]:
    """The settings of a run's command (:func:`command_settings`) that every run of one experiment shares: all but
    what a seed (:data:`SEED_KEYS`, the grader's seeds), a resume (:data:`RESUME_KEYS`) and, ``across_arms``, an arm
    (:data:`ARM_KEYS`, ``algorithm.setgrpo.*``) changes.

    Raises:
        ReportError: see :func:`command_settings`.
    """
    out = {}
    for key, value in command_settings(command).items():
        if key in SEED_KEYS or key in RESUME_KEYS or (across_arms and (key in ARM_KEYS or key.startswith(_ARM_PREFIX))):
            continue
        out[key] = _SEED.sub(r"\1seed:*", value) if key == _GRADER else value
    return out


def differing_settings(theirs: str, ours: str) -> list[tuple[str, str | None, str | None]]:
    """The settings in which a run's command ``theirs`` (its ``command.sh``) and the command ``ours`` that would run
    it now differ, as ``[(key, theirs, ours)]`` sorted by key (None: not set, verl's default); what a resume changes
    (:data:`RESUME_KEYS`) is not compared.

    Raises:
        ReportError: see :func:`command_settings`.
    """
    a, b = command_settings(theirs), command_settings(ours)
    keys = sorted((set(a) | set(b)) - RESUME_KEYS)
    return [(k, a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)]


def check_same_experiment(commands: Mapping[str, str], where: str) -> None:
    """Refuse runs of one analysis that are not one experiment: their :func:`experiment_settings` differ (the
    learning rate, K, groups per step, response length, the grader, the precision, the steps, ...), or two runs of
    one arm (``<arm>_s<seed>``) differ in the arm's own settings too (SetGRPO's ``algorithm.setgrpo.*``, ...).

    Args:
        commands: ``{run name: the run's command.sh text}``.
        where: the run directory or analysis the message names first.

    Raises:
        ReportError: naming the first differing setting, each run's value (``not set`` for verl's default) and the
            fix; or a command that is not a verl command line (see :func:`command_settings`).
    """
    arms: dict[str, list[str]] = {}  # the runs of each arm (``<arm>_s<seed>``) also share the arm's own settings
    for run in commands:
        arms.setdefault(run.rpartition("_s")[0] or run, []).append(run)
    groups = [(list(commands), True)] + [(runs, False) for runs in arms.values() if len(runs) > 1]
    for runs, across_arms in groups:
        _check_one(commands, runs, where, across_arms=across_arms)


def _check_one(commands: Mapping[str, str], runs: list[str], where: str, *, across_arms: bool) -> None:
    settings = {}
    for run in runs:
        try:
            settings[run] = experiment_settings(commands[run], across_arms=across_arms)
        except ReportError as exc:
            raise ReportError(f"{where}: {run}'s command.sh is {exc}") from None
    keys = sorted(set().union(*settings.values())) if settings else []
    for key in keys:
        values = {run: s.get(key) for run, s in settings.items()}
        if len(set(values.values())) > 1:
            shown = ", ".join(f"{run} {'not set' if v is None else v}" for run, v in sorted(values.items()))
            raise ReportError(f"{where}: runs of different experiments: {key} differs ({shown}); one analysis "
                              "compares runs made with the same settings: analyse each apart, or finish the runs "
                              "again with one command")
