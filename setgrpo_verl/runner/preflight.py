"""Checks before verl starts (docs/cli.md): the requested levels, whether the calibration (or validation) prompts
can be enough for them, a training split disjoint from the record's calibration prompts, and an HTTP judge that
answers. Each raises :class:`~setgrpo_verl.rundir.LaunchError` naming the flag to change; none writes anything.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from .console import override_value
from ..rundir import LaunchError

__all__ = ["calibration_minimums", "check_calibration_size", "check_stage_configs", "check_training_prompts",
           "check_training_steps", "check_validation_size", "probe_judge", "requested_settings"]

#: The command-line flag of each ``algorithm.setgrpo`` key that has one.
_FLAGS = {"alpha": "--alpha", "beta": "--beta", "delta": "--delta", "tau_grid": "--tau-grid", "rho": "--rho",
          "ablation": "--ablation", "fixed_tau": "--fixed-tau", "calibration.on_infeasible": "--on-infeasible"}
#: The ``algorithm.setgrpo`` keys the calibration settings are made of (the rest is left to the run's own check).
_SETTING_KEYS = ("alpha", "beta", "delta", "tau_grid", "rho", "recovery_grid", "ablation", "fixed_tau",
                 "srgo_procedure", "tau_start")
_CALIBRATION_KEYS = ("on_infeasible", "coverage_groups")


def requested_settings(values: Mapping[str, Any]) -> Any:
    """The :class:`setgrpo_verl.core.CalibrationSettings` of ``values`` (``algorithm.setgrpo.*``, schema defaults
    where missing), as ``SetGRPOConfig.calibration_settings`` builds them for the run itself.

    Raises:
        LaunchError: naming the flag (or key) and the admissible range.
    """
    from ..integration.config import SetGRPOCalibrationConfig, SetGRPOConfig

    def given(keys: Sequence[str], prefix: str) -> dict[str, Any]:
        return {key: values[prefix + key] for key in keys if prefix + key in values}

    try:
        config = SetGRPOConfig(**given(_SETTING_KEYS, "algorithm.setgrpo."), calibration=SetGRPOCalibrationConfig(
            **given(_CALIBRATION_KEYS, "algorithm.setgrpo.calibration.")))
        return config.calibration_settings(norm_by_std=bool(values.get("algorithm.norm_adv_by_std_in_grpo", True)))
    except ValueError as exc:
        text = str(exc).removeprefix("algorithm.setgrpo.")
        key = text.split("=", 1)[0]
        raise LaunchError(f"{_FLAGS.get(key, 'algorithm.setgrpo.' + key)}: {text}") from None


def _requested_levels(values: Mapping[str, Any]) -> tuple[float, float, float, Sequence[float]]:
    """``(alpha, beta, delta, tau_grid)`` of :func:`requested_settings`."""
    settings = requested_settings(values)
    return settings.alpha, settings.beta, settings.delta, settings.tau_grid


def calibration_minimums(values: Mapping[str, Any]) -> tuple[int, int]:
    """``(coverage groups, risk groups)`` the requested levels need at the least (docs/algorithm.md#2-jrsc, #4-srgo).

    Coverage needs ``min_calibration_groups(alpha)`` non-degenerate coverage groups; the risk bound needs the smallest
    N whose Clopper-Pearson bound with no reversal, at confidence ``1 - delta/m`` (``1 - delta`` for the fixed
    sequence), is at most beta.

    Args:
        values: config keys and values (``algorithm.setgrpo.*``; missing ones take the schema defaults).
    """
    from ..core.jrsc import min_calibration_groups
    from ..core.srgo import required_accepted_groups

    settings = requested_settings(values)  # the fixed sequence tests at delta: 36 instead of 72 at the paper's levels
    return min_calibration_groups(settings.alpha), required_accepted_groups(
        settings.beta, settings.delta, len(settings.tau_grid), procedure=settings.srgo_procedure)


def _levels(values: Mapping[str, Any]) -> str:
    alpha, beta, delta, grid = _requested_levels(values)
    return f"alpha={alpha}, beta={beta}, delta={delta} over {len(grid)} thresholds"


def _calibration_prompts(values: Mapping[str, Any]) -> int:
    from ..integration.config import SetGRPOCalibrationConfig

    return int(values.get("algorithm.setgrpo.calibration.num_prompts", SetGRPOCalibrationConfig.num_prompts))


def check_calibration_size(values: Mapping[str, Any]) -> None:
    """Fail before any rollout when the calibration prompts cannot possibly be enough for the requested levels.

    The calibration groups are split 50/50 (docs/algorithm.md#2-jrsc, #4-srgo), so they must number at least twice
    the larger of the two :func:`calibration_minimums`.

    Args:
        values: config keys and values (``algorithm.setgrpo.*``; missing ones take the schema defaults).

    Raises:
        LaunchError: naming both minima and the flags to change.
    """
    need_cov, need_risk = calibration_minimums(values)
    groups = _calibration_prompts(values)
    need = 2 * max(need_cov, need_risk)
    if groups < need:
        raise LaunchError(
            f"--calib-groups {groups} is too small: {_levels(values)} need >= {need_cov} non-degenerate coverage groups "
            f"and >= {need_risk} accepted risk groups even with no reversal; with the 50/50 split use --calib-groups "
            f">= {need} (more, since groups with tied scores are dropped), or raise --alpha / --beta / --delta")


def check_validation_size(values: Mapping[str, Any], holdout_fraction: float) -> str | None:
    """The sample-size check of ``validate`` (docs/validation.md#validation), before any rollout.

    Each split calibrates on the groups that are not held out. Too few for the coverage minimum is an error (no split
    could calibrate); too few for the risk minimum is allowed -- the coverage check still means something, and
    every split will then report that no threshold is risk-feasible -- and returned as a warning text.

    Returns:
        None, or a warning naming the risk minimum.

    Raises:
        LaunchError: too few calibration groups per split for alpha.
    """
    need_cov, need_risk = calibration_minimums(values)
    groups = _calibration_prompts(values)
    calibration = groups - int(round(groups * holdout_fraction))

    def total(need: int) -> int:
        n = need
        while n - int(round(n * holdout_fraction)) < need:
            n += 1
        return n

    if calibration < 2 * need_cov:
        raise LaunchError(
            f"--calib-groups {groups} with --holdout-fraction {holdout_fraction:g} leaves {calibration} calibration groups "
            f"per split, but {_levels(values)} need >= {need_cov} non-degenerate coverage groups, i.e. {2 * need_cov} "
            f"with the 50/50 split: use --calib-groups >= {total(2 * need_cov)} or raise --alpha")
    if calibration < 2 * need_risk:
        return (f"{calibration} calibration groups per split cannot certify {_levels(values)}: that needs >= "
                f"{need_risk} accepted risk groups with no reversal, i.e. >= {total(2 * need_risk)} --calib-groups; every "
                "split will find no risk-feasible threshold and accept nothing, and only the coverage check is "
                "informative")
    return None


def probe_judge(grader: Mapping[str, Any]) -> None:
    """:func:`setgrpo_verl.integration.judge_access.probe_judge`, before the command writes anything.

    Raises:
        LaunchError: the judge cannot be reached or does not answer (the message names the model, the URL and the
            HTTP status or connection error).
    """
    from ..integration.judge_access import probe_judge as probe

    try:
        probe(grader, fix="fix --judge-base-url (the server's OpenAI-compatible /v1 endpoint) or --judge-model (a name "
                          "the server serves), and export OPENAI_API_KEY if the judge needs a key")
    except ValueError as exc:
        raise LaunchError(str(exc)) from None


def check_training_prompts(record: str | os.PathLike, run_dir: str | os.PathLike) -> None:
    """Refuse a training split that holds a prompt the record was calibrated on (by id or question text).

    Raises:
        LaunchError: naming the first such prompt (:func:`setgrpo_verl.core.compatibility.check_disjoint`), or a
            record that does not validate.
    """
    from ..core import CalibrationRecord
    from ..core.compatibility import check_disjoint
    from ..integration.prompts import read_prompt_identities

    train = Path(run_dir) / "data" / "train.parquet"
    try:
        check_disjoint(CalibrationRecord.from_json(record), read_prompt_identities(train), source=str(train))
    except ValueError as exc:
        raise LaunchError(str(exc)) from None


#: verl 0.9.1's ``trainer.total_epochs`` default (``ppo_trainer.yaml``).
VERL_TOTAL_EPOCHS = 30


def check_training_steps(values: Mapping[str, Any], overrides: Sequence[str], train_prompts: int) -> None:
    """Refuse ``--steps`` that verl's epochs would cut short (it would stop early, exit 0 and the stage be complete).

    verl's trainer takes ``len(train) // data.train_batch_size`` steps per epoch (the last partial batch is
    dropped) and stops after ``trainer.total_epochs`` epochs even when ``trainer.total_training_steps`` asks for more.

    Args:
        values: the command's config values (``trainer.total_training_steps``, ``data.train_batch_size``,
            ``trainer.total_epochs``).
        overrides: the user's own Hydra overrides (they win over ``values``).
        train_prompts: the rows of the training split.

    Raises:
        LaunchError: the steps asked for exceed steps per epoch x epochs, naming both and the fixes.
    """
    steps = override_value(overrides, "trainer.total_training_steps") or values.get("trainer.total_training_steps")
    if steps in (None, "null"):
        return
    batch = int(override_value(overrides, "data.train_batch_size") or values["data.train_batch_size"])
    epochs = int(override_value(overrides, "trainer.total_epochs") or values.get("trainer.total_epochs")
                  or VERL_TOTAL_EPOCHS)
    per_epoch = int(train_prompts) // batch
    if int(steps) <= per_epoch * epochs:
        return
    need = -(-int(steps) // per_epoch) if per_epoch else None
    raise LaunchError(
        f"--steps {steps}: the training split has {train_prompts} prompts, {per_epoch} steps of {batch} groups per "
        f"epoch (verl drops the last partial batch), and trainer.total_epochs={epochs} stops verl after "
        f"{per_epoch * epochs} steps: lower --steps to {per_epoch * epochs}"
        + (f", raise trainer.total_epochs to {need}" if need else "")
        + " or give more training prompts")


def check_stage_configs(commands: Sequence[tuple[str, Sequence[str]]], *,
                        calibration_prompts: Sequence[dict] | None = None, environment: bool = True) -> None:
    """The check that verl's ``main_ppo`` runs before Ray (:func:`setgrpo_verl.integration.run_check.check_run_config`,
    through the Hydra callback), made on each stage's config as Hydra composes it from the stage's command line,
    before anything is written (docs/cli.md#run-directory).

    Args:
        commands: ``(stage, argv)`` of each ``python -m verl.trainer.main_ppo --config-name NAME overrides...``.
        calibration_prompts: fingerprints of the calibration prompts about to be written (the data split), for the
            checks that read them; None = the run directory's files.
        environment: False (a dry run) leaves out the GPU kernel packages.

    Raises:
        LaunchError: a config Hydra cannot compose, or what ``check_run_config`` refuses, naming the stage.
    """
    from hydra import compose, initialize_config_module

    from ..integration.run_check import check_run_config

    for stage, argv in commands:
        at = list(argv).index("--config-name")
        try:
            with initialize_config_module("verl.trainer.config", version_base=None):
                config = compose(argv[at + 1], overrides=list(argv[at + 2:]))
        except Exception as exc:  # Hydra's ConfigCompositionException / OmegaConf's errors name the override
            raise LaunchError(f"verl cannot compose the {stage} stage's config: {exc}") from None
        try:
            check_run_config(config, calibration_prompts=calibration_prompts, environment=environment)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
