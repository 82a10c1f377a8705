"""The check of a whole run before Ray (docs/verl_integration.md#refused-before-ray): :func:`check_run_config` and
the Hydra callback that runs it when ``main_ppo`` starts (:class:`SetGRPOConfigCheck`), the compatibility of a
calibration record with a run (:func:`check_record`) and of training data with a record
(:func:`check_training_data`). The ``algorithm.setgrpo`` schema it validates is :mod:`.config`.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

from hydra.experimental.callback import Callback

from setgrpo_verl.core import CalibrationRecord
from setgrpo_verl.core.compatibility import check_compatible, check_disjoint
from setgrpo_verl.grading import check_stochastic_grader

from .config import RELIABILITY_VARIANT, SETGRPO_NAME, TRAINER_MODE_OVERRIDE, SetGRPOConfig, setgrpo_config_from
from .gpu_env import check_driver_gpus
from .judge_access import check_judge_access, judge_probe_line, pass_judge_key
from .identity import IDENTITY_SOURCES, carry_policy_files, run_identity
from .prompts import check_calibration_disjoint, check_start_pilot, read_prompt_identities
from .resume import check_resume
from .rollout_settings import check_rollout_settings
from .run_env import check_run_env, pass_run_env
from .reward_config import (POINT_KEY, REWARD_MANAGER_NAME, SCORINGS_KEY, check_filter_groups, grader_config,
                            grader_identity, point_mode, reference_score_key, scorings)
from .micro_batch import check_sketch_micro_batch
from .support import check_attention_kernels, check_sketch_support, check_trainer_settings

__all__ = ["SetGRPOConfigCheck", "check_calibration_part", "check_record", "check_run_config", "check_training_data"]


def check_record(record: Any, config: Any, setgrpo: SetGRPOConfig) -> None:
    """The one compatibility check of a calibration record against a run (docs/record.md#compatibility-with-a-run).

    Args:
        record: a :class:`setgrpo_verl.core.CalibrationRecord`.
        config: the composed verl config of the run.
        setgrpo: its validated ``algorithm.setgrpo`` block.

    Raises:
        ValueError: naming the first field whose value differs: K, coefficient mode, alpha / beta / delta / rho,
            ablation, loss aggregation, or a key of the sketch, grader, policy or training identity (with the config
            key that sets it), or policy files that cannot be read (:func:`~.identity.run_identity`).

    Warns:
        IdentityWarning: a record written before some identity fields existed, naming them (not checked).
    """
    check_compatible(record, sources=IDENTITY_SOURCES, K=int(config.actor_rollout_ref.rollout.n), alpha=setgrpo.alpha,
                     norm_by_std=bool(config.algorithm.get("norm_adv_by_std_in_grpo", True)), beta=setgrpo.beta,
                     delta=setgrpo.delta, rho=setgrpo.rho, ablation=setgrpo.ablation, **run_identity(config, setgrpo))


def _check_reward(config: Any, *, setgrpo: bool, needs_reference: Optional[str] = None) -> None:
    """The dual-reward manager's grader, reference-score key and scorings, as verl's reward worker will read them;
    ``setgrpo``: a SetGRPO run (``point=mean`` is refused); ``needs_reference``: what reads the reference score in
    this run (then one scoring, or a grader that scores a response alike twice, is refused), or None."""
    reward = config.get("reward", None) if hasattr(config, "get") else None
    manager = reward.get("reward_manager", None) if reward is not None else None
    if manager is None or str(manager.get("name", "")) != REWARD_MANAGER_NAME:
        return
    try:
        grader_identity(config)
    except ValueError as exc:
        raise ValueError(f"reward.reward_kwargs.grader: {exc}") from None
    check_judge_access(grader_config(config), int(config.trainer.get("nnodes", 1) or 1))
    reference_score_key(config)
    mode = point_mode(config)  # a value other than first and mean, or mean with one scoring, in every trainer mode
    if setgrpo and mode == "mean":
        raise ValueError(f"{POINT_KEY}=mean: SetGRPO reads the two scorings apart (the point r and the reference r'); "
                         f"remove the key (it is for the GRPO baseline on the mean of two scorings), or use "
                         "algorithm.setgrpo.variant=reliability, which trains on the mean itself")
    count = scorings(config)  # a value other than 1 and 2 is refused in every trainer mode
    if needs_reference:
        check_stochastic_grader(grader_config(config))
    if needs_reference and count == 1:
        raise ValueError(f"{SCORINGS_KEY}=1: SetGRPO needs the reference score r' of a second scoring here "
                         f"({needs_reference}); set {SCORINGS_KEY}=2 or leave it unset (1 is for the GRPO baseline, "
                         "and for paper-variant training with a record and algorithm.setgrpo.monitor.enable=false)")


def check_run_config(config: Any, *, calibration_prompts: Optional[Sequence[dict]] = None,
                     environment: bool = True) -> Optional[SetGRPOConfig]:
    """Fail fast on a run config that mixes SetGRPO and verl settings inconsistently (before Ray starts).

    Args:
        config: the composed verl config (``main_ppo``'s).
        calibration_prompts: the :func:`setgrpo_verl.core.record.prompt_fingerprint` list of the prompts the run will
            calibrate on, when they are known before the files are written (the command line's split); None =
            every row of the files the calibration samples.
        environment: False leaves out the GPU checks: the installed kernel packages and the driver (a dry run, and
            verl's TaskRunner, a Ray actor without GPUs where the driver and the workers have checked).

    Returns:
        The validated :class:`SetGRPOConfig` when the run uses SetGRPO, else None.

    Raises:
        ValueError: ``algorithm.adv_estimator=setgrpo`` without ``trainer.v1.trainer_mode=setgrpo`` (the message names
            the missing override) or the reverse; with the ``setgrpo_dual`` reward manager (any trainer mode), a grader
            config that verl's reward worker could not build (unknown type, misspelled or missing key) or a
            ``reward.reward_kwargs.reference_score_key`` or ``reward.reward_kwargs.scorings`` other than 1 or 2 (for
            SetGRPO, other than 2: it reads the reference score) and, where SetGRPO reads it, a grader that scores
            alike twice (:func:`~setgrpo_verl.grading.check_stochastic_grader`); ``actor_rollout_ref.rollout.n < 2``,
            an invalid ``algorithm.setgrpo`` block (the levels, grid, rho, ablation and recovery grid as
            :class:`setgrpo_verl.core.CalibrationSettings` validates them for ``calibrate``), a fixed sketch
            micro-batch that does not divide a rank's batch (:func:`check_sketch_micro_batch`), or an
            ``algorithm.setgrpo.record_path`` that is missing, does not validate or does not match the run
            (:func:`check_record`), a policy whose files the run identity cannot read
            (:func:`~.identity.run_identity`), or training data holding one of its calibration prompts
            (:func:`check_training_data`); for a run that calibrates, a ``calibration.shard`` part that holds no batch
            (:func:`check_calibration_part`) or a ``tau_start_pilot`` that is no pilot of these prompts
            (:func:`~.prompts.check_start_pilot`); DAPO group filtering (``algorithm.filter_groups``) in a calibration
            run or on a metric the reward manager does not emit (:func:`~.reward_config.check_filter_groups`); for any
            trainer mode, unless ``environment`` is False, an actor ``attn_implementation`` whose kernel package is not
            importable (:func:`~.support.check_attention_kernels`) and, with an NVIDIA driver here, a GPU environment
            verl cannot run in (:func:`~.gpu_env.check_driver_gpus`); with ``setgrpo_dual``, a judge a reward worker
            could not use (:func:`~.judge_access.check_judge_access`); for SetGRPO, ``trainer.use_v1=false``, an actor
            strategy other than fsdp / fsdp2 or a sketch token budget below one full-length sequence
            (:func:`~.support.check_trainer_settings`); for any trainer mode, rollout settings whose effect would be
            silent (``full_determinism`` with ``n > 1``, settings the CPU rollout does not implement:
            :func:`~.rollout_settings.check_rollout_settings`).
    """
    check_rollout_settings(config)
    if not _uses_setgrpo(config):
        _check_reward(config, setgrpo=False)
        check_filter_groups(config, setgrpo=False, calibration_only=False)
        _check_environment(config, environment)
        return None
    if config.actor_rollout_ref.rollout.n < 2:
        raise ValueError("SetGRPO needs groups: set actor_rollout_ref.rollout.n >= 2 (the paper uses 8)")
    setgrpo = setgrpo_config_from(config.algorithm)
    setgrpo.calibration_settings(norm_by_std=bool(config.algorithm.get("norm_adv_by_std_in_grpo", True)))
    if setgrpo.variant == RELIABILITY_VARIANT:  # no calibration, record or sketches: only the reference is needed
        check_trainer_settings(config, setgrpo, sketches=False)
        _check_reward(config, setgrpo=True, needs_reference="the reliability variant trains on the mean of the two")
        check_filter_groups(config, setgrpo=False, calibration_only=False)  # no record whose groups it could skew
        check_resume(config, setgrpo)
        _check_environment(config, environment)
        return setgrpo
    check_trainer_settings(config, setgrpo)
    check_sketch_micro_batch(config, setgrpo)
    check_sketch_support(config, setgrpo.sketch.to_sketch_config())
    _check_reward(config, setgrpo=True, needs_reference=_reference_readers(setgrpo))
    check_filter_groups(config, setgrpo=True, calibration_only=setgrpo.calibration.only and not setgrpo.record_path)
    check_calibration_disjoint(config)
    if not setgrpo.record_path:
        check_calibration_part(config, setgrpo)
        check_start_pilot(config, setgrpo, calibration_prompts)
    if setgrpo.record_path:
        _check_record_path(config, setgrpo)
    else:  # the identity calibration will record: the policy's files are read now, not after the first rollout
        run_identity(config, setgrpo)
    check_resume(config, setgrpo)
    _check_environment(config, environment)  # the environment last: a wrong setting is named before a missing package
    return setgrpo


def _uses_setgrpo(config: Any) -> bool:
    """Whether the run uses SetGRPO; refuses the SetGRPO estimator without the SetGRPO trainer mode or the reverse."""
    estimator = config.algorithm.adv_estimator
    trainer_mode = config.trainer.v1.trainer_mode
    if estimator == SETGRPO_NAME and trainer_mode != SETGRPO_NAME:
        raise ValueError(f"algorithm.adv_estimator={SETGRPO_NAME} needs the per-response gradient sketches that only "
                         f"the SetGRPO trainer mode computes, but trainer.v1.trainer_mode={trainer_mode}: add the "
                         f"override `{TRAINER_MODE_OVERRIDE}` (or use algorithm.adv_estimator=grpo for plain GRPO)")
    if trainer_mode == SETGRPO_NAME and estimator != SETGRPO_NAME:
        raise ValueError(f"{TRAINER_MODE_OVERRIDE} computes SetGRPO advantages: set "
                         f"algorithm.adv_estimator={SETGRPO_NAME} (got {estimator!r})")
    return trainer_mode == SETGRPO_NAME


def _reference_readers(setgrpo: SetGRPOConfig) -> Optional[str]:
    """What reads the reference score in a paper-variant run, for the reward check's message; None = nothing."""
    monitor = setgrpo.monitor.get("enable", True) if isinstance(setgrpo.monitor, Mapping) else setgrpo.monitor.enable
    readers = (["calibration fits the coefficient set and the risk gate on it"] if not setgrpo.record_path else []) + (
        ["the online monitor reads it during training"] if monitor else [])
    return "; ".join(readers) or None


def _check_record_path(config: Any, setgrpo: SetGRPOConfig) -> None:
    """Refuse a ``record_path`` that is missing or does not match the run, or training data holding its prompts."""
    path = os.path.expanduser(setgrpo.record_path)
    if not os.path.isfile(path):
        raise ValueError(f"algorithm.setgrpo.record_path={setgrpo.record_path}: no such file; pass the record a "
                         "calibration run wrote, or null to calibrate first")
    record = CalibrationRecord.from_json(path)
    check_record(record, config, setgrpo)
    if not setgrpo.calibration.only:
        prompt_key = str(config.data.get("prompt_key", "prompt"))
        check_training_data(record, config.data.train_files, prompt_key=prompt_key)


def _check_environment(config: Any, environment: bool) -> None:
    """The checks of the driver's environment (kernel packages, GPUs, wandb key, shared run folders:
    :func:`~.run_env.check_run_env`) unless ``environment`` is False (a dry run, the TaskRunner)."""
    if environment:
        check_attention_kernels(config)
        check_driver_gpus(config)
        check_run_env(config)


def check_calibration_part(config: Any, setgrpo: SetGRPOConfig) -> None:
    """Refuse, before Ray, a ``calibration.shard`` part that holds no calibration batch
    (docs/record.md#calibration-shards).

    The calibration has ``ceil(num_prompts / batch_size)`` batches (``batch_size``: ``calibration.batch_size``, else
    ``data.train_batch_size``) and part I of N takes batches I, I + N, ...; a part with none would start verl,
    calibrate nothing and end complete.

    Raises:
        ValueError: naming the part, how many batches the calibration has and the fixes.
    """
    cal = setgrpo.calibration
    index, parts = cal.part()
    size = int(cal.batch_size or config.data.train_batch_size)
    batches = -(-int(cal.num_prompts) // size)
    if index < batches:
        return
    raise ValueError(
        f"algorithm.setgrpo.calibration.shard={cal.shard} (--shard): part {index} holds no batch, since the "
        f"calibration has {batches} batch(es) ({cal.num_prompts} prompts in batches of {size}) and part I of N takes "
        f"batches I, I+N, ...: split it into at most {batches} parts (shard=I/{batches}) or use smaller calibration "
        "batches (calibration.batch_size, --calib-batch-size)")


def check_training_data(record: CalibrationRecord, train_files: Any, *, prompt_key: str = "prompt") -> None:
    """Refuse training files that contain a prompt the record was calibrated on, by id or by question text
    (docs/record.md#compatibility-with-a-run).

    Args:
        record: the calibration record.
        train_files: ``data.train_files`` (a parquet path or a list of them).
        prompt_key: verl's ``data.prompt_key``.

    Raises:
        ValueError: naming the file(s), the first overlapping prompt and how many there are.
    """
    files = [train_files] if isinstance(train_files, (str, os.PathLike)) else list(train_files)
    check_disjoint(record, read_prompt_identities(files, prompt_key=prompt_key),
                   source=f"data.train_files ({', '.join(str(f) for f in files)})")


class SetGRPOConfigCheck(Callback):
    """Hydra callback (``hydra.callbacks.setgrpo_check`` in ``setgrpo_trainer.yaml``): runs
    :func:`check_run_config` when ``main_ppo`` starts, before Ray and the workers are launched; then, with the
    ``setgrpo_dual`` reward manager, probes the HTTP judge its grader calls (:func:`~.judge_access.judge_probe_line`:
    unless ``SETGRPO_SKIP_JUDGE_PROBE=1``; a line says which) and passes ``OPENAI_API_KEY`` to the Ray workers
    through the job's runtime environment (:func:`setgrpo_verl.integration.judge_access.pass_judge_key`), with the
    fingerprints of the policy's files the check computed (:func:`~.identity.carry_policy_files`).

    Raises:
        SystemExit: with the :func:`check_run_config` or probe message (Hydra 1.3 turns ordinary exceptions raised by
            callbacks into warnings, so a plain ValueError would not stop the run).
    """

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        try:
            check_run_config(config)
        except ValueError as exc:
            raise SystemExit(f"setgrpo_verl config error: {exc}") from exc
        carry_policy_files()  # the TaskRunner uses the identity the driver accepted, not its own node's cache
        pass_run_env(config)  # wandb's key and settings to the TaskRunner, which does not inherit this shell
        manager = config.get("reward", {}).get("reward_manager", {}) or {}
        if str(manager.get("name", "")) != REWARD_MANAGER_NAME:
            return
        grader = grader_config(config)
        try:
            print(f"[setgrpo-verl] {judge_probe_line(grader)}", flush=True)
        except ValueError as exc:
            raise SystemExit(f"setgrpo_verl judge error: {exc}") from exc
        pass_judge_key(grader)  # the judge's key to every Ray worker, outside the config
