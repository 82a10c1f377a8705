"""The SetGRPO trainer mode for verl 0.9.1's v1 trainer (``trainer.v1.trainer_mode=setgrpo``).

:class:`SetGRPOTrainer` subclasses verl's ``PPOTrainerSync`` (registered with ``register_trainer``) and
changes exactly three things:

1. the actor worker is :class:`~setgrpo_verl.integration.worker.SetGRPOActorRolloutRefWorker` (sketch RPC);
2. after verl's old-log-prob pass every step fetches per-response gradient sketches (or, with
   ``algorithm.setgrpo.sketch.fuse_old_log_prob=true``, one fused pass gives both), and the advantage step calls
   :func:`~setgrpo_verl.integration.estimator.setgrpo_step` with the sketches and the frozen record in place of
   verl's ``compute_advantage``, writing ``advantages = returns = coefficient * response_mask`` as verl writes an
   estimator's answer, so verl's PPO loss runs unchanged;
3. before the first step it loads and validates ``algorithm.setgrpo.record_path`` or, when that is null,
   runs the calibration phase (:class:`~setgrpo_verl.integration.calibration.CalibrationPhase`,
   docs/algorithm.md#2-jrsc, #4-srgo, #7-record): roll out the calibration prompts with the initial policy (the
   same sampling as training), read the point (``rm_scores``) and reference scores from the dual-reward manager,
   sketch, write one shard per batch (docs/record.md#calibration-shards) and build the record from the complete
   shard set; ``calibration.only=true`` stops there.

Every diagnostic of docs/algorithm.md#6-diagnostics goes to verl's tracker under ``setgrpo/``; with reference scores
present during training the online coverage / reversal monitor runs and warns on drift.

Internally the trainer reports ``trainer_mode == "sync"`` to verl's base class so that the replay buffer,
dataloader and checkpoint logic behave exactly as in the stock sync trainer.

:class:`~setgrpo_verl.integration.sync_mode.GradedSyncTrainer` (``trainer.v1.trainer_mode=graded_sync``, the command
line's GRPO baseline) is verl's sync trainer plus the grading metrics of the reward manager, which verl's own trainer
does not log while training; what both trainers share is :class:`~setgrpo_verl.integration.sync_mode.SyncMode`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from typing import Any, Optional

import numpy as np
import torch
import transfer_queue as tq
from tensordict import TensorDict

from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import apply_kl_penalty
from verl.trainer.ppo.core_algos import agg_loss
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.debug import marked_timer
from verl.utils.debug.metrics import calculate_debug_metrics
from verl.workers.utils.padding import response_to_nested

from setgrpo_verl.core import CalibrationRecord, OnlineRiskMonitor
from setgrpo_verl.core.grpo import DEGENERATE_RTOL
from setgrpo_verl.core.record import content_sha256
from setgrpo_verl.core.record_text import table4_row
from setgrpo_verl.core.shards import SHARD_DIR

from .batch import dense_sketches, reference_scores_from, sketch_rows_field, sketched_rows
from .calibration import CalibrationPhase
from .config import RELIABILITY_VARIANT, SETGRPO_NAME, SetGRPOConfig
from .identity import run_identity
from .run_check import check_record, check_run_config
from .sync_mode import SyncMode
from .estimator import SetGRPOStep, reliability_step, setgrpo_step
from .groups import rows_to_sketch
from .resume import (check_state, read_state, record_out_path, resume_folder, write_state)
from .reward_manager import GRADING_COUNT_KEYS, grading_metrics
from .worker import (SKETCH_CONFIG_KEY, SKETCH_KEY, SKETCH_ROWS_KEY, SetGRPOActorRolloutRefWorker)

logger = logging.getLogger(__name__)

_ADV_FIELDS = ["uid", "response_mask", "rm_scores", "rollout_log_probs", "old_log_probs", "ref_log_prob", "values"]


def compute_setgrpo_advantage(data: DataProto, sketches: torch.Tensor, record: CalibrationRecord,
                              **step_kwargs: Any) -> SetGRPOStep:
    """The SetGRPO step of one training batch, written into ``data`` as verl writes an estimator's answer
    (docs/algorithm.md#3-ggsr, #6-diagnostics; docs/verl_integration.md#trainer-mode).

    verl 0.9.1's v1 trainer hands every estimator but GRPO to ``ray_trainer.compute_advantage`` (through
    ``v1.utils.compute_advantage_for_multi_trajectories``), which calls a registered estimator with
    ``token_level_rewards``, ``response_mask``, ``index=non_tensor_batch["uid"]`` and sets ``advantages`` and
    ``returns`` to its two outputs; that is done here, with :func:`setgrpo_step` as the estimator. What else that
    wrapper does does not apply: the trainer always fetches ``response_mask`` and never ``reward_baselines``.
    tests/integration/test_estimator.py fingerprints verl's functions.

    Args:
        data: DataProto with ``token_level_rewards`` [B, T], ``response_mask`` [B, T] and ``uid`` [B]
            (``non_tensor_batch``); gets ``advantages`` and ``returns``, float32 [B, T], the same tensor.
        sketches: float32 [B, m] sketches, row-aligned with ``data``.
        record: the frozen ``CalibrationRecord``.
        **step_kwargs: ``reference_scores``, ``monitor``, ``ablation``, ``seed``, ``sketched`` of :func:`setgrpo_step`.

    Returns:
        The step's :class:`SetGRPOStep` (coefficients, groups, ``setgrpo/*`` metrics).

    Raises:
        ValueError: see :func:`setgrpo_step`.
    """
    step = setgrpo_step(data.batch["token_level_rewards"], data.batch["response_mask"], data.non_tensor_batch["uid"],
                        sketches, record, **step_kwargs)
    data.batch["advantages"] = step.advantages
    data.batch["returns"] = step.advantages
    return step


def _group_log_rows(step: SetGRPOStep, global_step: int) -> list[dict[str, Any]]:
    """One JSON object per group of a step: status, recovery ratio, projections, point scores."""
    result = step.result
    rows = []
    for g in range(step.groups.shape[0]):
        def num(x):
            v = float(x[g])
            return None if math.isnan(v) else v

        rows.append({
            "step": global_step,
            "group": g,
            "status": str(result.status[g]),
            "accepted": bool(result.accepted[g]),
            "recovery_ratio": num(result.recovery_ratio),
            "m_full": num(result.m_full),
            "m_reward": num(result.m_reward),
            "point": [float(v) for v in step.point_scores[g].tolist()],
            "coefficients": [float(v) for v in torch.as_tensor(result.coefficients[g]).tolist()],
        })
    return rows


def _reliability_log_rows(step: Any, global_step: int) -> list[dict[str, Any]]:
    """The reliability variant's group-log rows, in the paper's row format: ``status`` is ``trained`` or
    ``zero_weight``, ``weight`` the group's reliability weight, ``point`` the mean of the two scorings; the
    recovery ratio and projections, which this variant does not compute, are null."""
    rows = []
    for g in range(step.groups.shape[0]):
        w = float(step.weights[g])
        rows.append({
            "step": global_step, "group": g, "status": "trained" if w > 0 else "zero_weight", "accepted": w > 0,
            "weight": w, "recovery_ratio": None, "m_full": None, "m_reward": None,
            "point": [float(v) for v in step.point_scores[g].tolist()],
            "coefficients": [float(v) for v in step.coefficients[step.groups[g]].tolist()],
        })
    return rows


@register_trainer(SETGRPO_NAME)
class SetGRPOTrainer(SyncMode, CalibrationPhase, PPOTrainerSync):
    """verl sync PPO trainer with SetGRPO calibration, sketches and gated advantages (see module docstring).

    Raises (at construction):
        ValueError: ``algorithm.adv_estimator`` is not ``setgrpo``, ``rollout.n < 2``, a critic is configured,
            or the ``algorithm.setgrpo`` block is missing / invalid.
    """

    registered_mode = SETGRPO_NAME
    actor_worker = SetGRPOActorRolloutRefWorker

    def __init__(self, config):
        # the driver and every actor worker check the GPU environment; this TaskRunner is a Ray actor without GPUs
        self.setgrpo: SetGRPOConfig = check_run_config(config, environment=False)
        self.sketch_config = self.setgrpo.sketch.to_sketch_config()
        self.record: Optional[CalibrationRecord] = None
        self.monitor: Optional[OnlineRiskMonitor] = None
        self._accepted_groups: Optional[int] = None
        self._record_sha256: Optional[str] = None
        super().__init__(config)
        if self.use_critic:
            raise ValueError("SetGRPO is critic-free (outcome-level estimator): remove the critic configuration")

    # ------------------------------------------------------------------ record
    @property
    def _reliability(self) -> bool:
        """The ``reliability`` variant: no calibration, record or sketches."""
        return self.setgrpo.variant == RELIABILITY_VARIANT

    def _run_identity(self) -> dict[str, Any]:
        return run_identity(self.config, self.setgrpo)

    def _check_record(self, record: CalibrationRecord) -> None:
        check_record(record, self.config, self.setgrpo)

    def _log_record(self, record: CalibrationRecord, metrics: Optional[dict] = None, **extra: float) -> None:
        """The record's Table 4 columns as ``setgrpo/calibration/*`` metrics in verl's tracker, with ``metrics``
        (full names) in the same line."""
        table4 = {"n_cov": record.n_cov, "n_risk": record.n_risk, "q_alpha": record.q_alpha, "tau_sel": record.tau_sel,
                  "N": record.N, "F": record.F, "ecr": record.ecr, "U": record.U, **extra}
        summary = {f"setgrpo/calibration/{k}": float(v) for k, v in table4.items() if v is not None}
        summary.update(metrics or {})
        if getattr(self, "logger", None) is not None:
            self.logger.log(data=summary, step=self.global_steps)

    def _record_out(self) -> str:
        return record_out_path(self.config, self.setgrpo)

    def on_train_begin(self):
        """Two steps: load the record (``record_path``, or on a resume the record this run wrote) or calibrate, then,
        on a resume, restore SetGRPO's state from the checkpoint folder verl loaded (:func:`resume_folder`, the
        same choice as verl's ``_load_checkpoint`` and the check before Ray).

        Raises:
            ValueError: a resume without a record, an existing record that calibration would overwrite, or a
                checkpoint trained with another record (:func:`setgrpo_verl.integration.resume.check_state`).
        """
        super().on_train_begin()
        resumed = self.global_steps > 1  # verl's fit() counts from the checkpoint's step + 1
        if self._reliability:  # no calibration and no record (docs/algorithm.md#9-reliability-weighting)
            if resumed:
                folder = resume_folder(self.config)
                if folder is not None:
                    self._restore_setgrpo_state(folder, None)
            return
        self.record, loaded = self._load_or_calibrate(resumed=resumed)
        if self.record is None:  # a part of a sharded calibration: its shards are written, there is no record
            raise _CalibrationDone(os.path.join(os.path.dirname(os.path.abspath(self._record_out())), SHARD_DIR))
        self._record_sha256 = content_sha256(self.record)
        if self.setgrpo.monitor.enable:
            self.monitor = OnlineRiskMonitor(self.record)
        restored = False
        if resumed:
            folder = resume_folder(self.config)
            if folder is None:
                raise ValueError(f"verl resumed at step {self.global_steps - 1}, but trainer.resume_mode="
                                 f"{self.config.trainer.get('resume_mode', 'auto')} names no checkpoint folder")
            restored = self._restore_setgrpo_state(folder, loaded)
        if loaded and not restored:
            self._log_record(self.record)
        if self.setgrpo.calibration.only and not self.setgrpo.record_path:
            raise _CalibrationDone(self._record_out())

    def _load_or_calibrate(self, *, resumed: bool) -> tuple[Optional[CalibrationRecord], Optional[str]]:
        """The run's record and the path it was loaded from (None when calibrated now; the record is None for a part
        of a sharded calibration): ``record_path``; on a
        resume without one, the record this run wrote at its start (never a recalibration on a trained policy);
        else a new calibration into ``record_out``, which must not exist yet (a frozen record is never
        overwritten)."""
        record_path, out = self.setgrpo.record_path, self._record_out()
        if not record_path and resumed:
            if not os.path.exists(out):
                raise ValueError(
                    f"resuming at step {self.global_steps} without a calibration record: calibration must use the "
                    f"initial policy; pass the original record as algorithm.setgrpo.record_path ({out} does not exist)"
                )
            record_path = out
        if record_path:
            record = CalibrationRecord.from_json(os.path.expanduser(record_path))
            self._check_record(record)
            logger.warning("SetGRPO: loaded calibration record %s: %s", record_path, table4_row(record))
            return record, record_path
        if os.path.exists(out):
            raise ValueError(
                f"calibration record {out} already exists: pass it as algorithm.setgrpo.record_path to reuse it, or "
                f"set algorithm.setgrpo.record_out to a new folder to recalibrate, or delete it together with "
                f"{SHARD_DIR}/ and paired_scores.npz next to it (deleting the record alone builds the same record "
                "again from the shards, with no new rollout; a frozen record is never overwritten)"
            )
        return self._calibrate(), None

    # ------------------------------------------------------------------ checkpoints (docs/cli.md#resuming-a-run)
    def _checkpoint_folder(self, step: int) -> str:
        return os.path.join(self.config.trainer.default_local_dir, f"global_step_{step}")

    def _write_setgrpo_state(self, folder: str) -> str:
        """SetGRPO's state of the current step (record hash, monitor counts, group-log size) into ``folder``."""
        log = os.path.expanduser(self.setgrpo.group_log) if self.setgrpo.group_log else None
        size = (os.path.getsize(log) if os.path.exists(log) else 0) if log else None
        return write_state(folder, step=self.global_steps, record_sha256=self._record_sha256,
                           monitor=self.monitor.state_dict() if self.monitor is not None else None,
                           group_log_bytes=size)

    def _save_checkpoint(self):
        """verl's checkpoint of this step, SetGRPO's state written into the folder first, so that verl's
        ``latest_checkpointed_iteration.txt`` never names a checkpoint without it."""
        self._write_setgrpo_state(self._checkpoint_folder(self.global_steps))
        return super()._save_checkpoint()

    def _restore_setgrpo_state(self, folder: str, record_path: str) -> bool:
        """On resume from checkpoint ``folder``: check its record hash, continue the monitor and cut the group log
        back to the checkpoint's step; True when restored (the metrics rows are restored by ``SyncMode``).

        Raises:
            ValueError: the checkpoint was trained with another record or has no SetGRPO state (see
                :func:`setgrpo_verl.integration.resume.check_state`).
        """
        step = self.global_steps - 1
        state = read_state(folder)
        if not check_state(folder, state, record_path, self._record_sha256, self.setgrpo.resume_other_record):
            logger.warning("SetGRPO: resuming %s with another calibration record (resume_other_record=true): the "
                           "online monitor starts from zero", folder)
            return False
        if self.monitor is not None and state.get("monitor") is not None:
            self.monitor.load_state_dict(state["monitor"])
        log, size = self.setgrpo.group_log, state.get("group_log_bytes")
        if log and size is not None and os.path.exists(os.path.expanduser(log)):
            path = os.path.expanduser(log)
            if os.path.getsize(path) < size:
                logger.warning("SetGRPO: group log %s is shorter than at the checkpoint of step %d", path, step)
            else:
                os.truncate(path, size)  # the steps after the checkpoint are trained again
        logger.warning("SetGRPO: resumed after step %d: record sha256 %s, monitor %s", step, self._record_sha256,
                       None if self.monitor is None else self.monitor.state_dict())
        return True

    def fit(self, agent_loop_manager):
        try:
            return super().fit(agent_loop_manager)
        except _CalibrationDone as done:
            logger.warning("SetGRPO: calibration.only=true - written to %s, stopping before training", done)
            self._shutdown_dump_executor()

    # ------------------------------------------------------------------ per step
    def _compute_reward_colocate(self, batch, metrics: Optional[dict] = None):
        """verl's reward in the trainer process (a reward model without its own pool), with the fields it wrote
        (``rm_scores`` and the reward's ``reward_extra_keys``: the reference score, verdict counts, truth) added to
        ``batch.fields``, so that calibration and the advantage read them like the streaming reward loop's.

        verl 0.9.1 ``PPOTrainer._compute_reward_colocate`` writes those fields to TransferQueue but returns the
        batch's metadata unchanged; the keys are taken from the reward output it writes.
        """
        manager = self.reward_loop_manager
        compute, own = manager.compute_rm_score, "compute_rm_score" in vars(manager)
        written: list[str] = []

        def recording(rm_input):
            output = compute(rm_input)
            written.extend(output.meta_info.get("reward_extra_keys", []))
            return output

        manager.compute_rm_score = recording
        try:
            batch = super()._compute_reward_colocate(batch, metrics=metrics)
        finally:
            if own:
                manager.compute_rm_score = compute
            else:
                del manager.compute_rm_score  # the class's method again
        if batch.fields is not None:  # None selects every field, the ones just written included
            batch.fields = list(dict.fromkeys([*batch.fields, "rm_scores", *written]))
        return batch

    def _compute_sketches(self, batch, fused: bool = False) -> None:
        """Sketch RPC on the actor workers; the sketches land in TransferQueue under ``setgrpo_sketch``
        (with ``fused``, verl's ``old_log_probs`` too, from the same forward).

        Only the rows of groups that can update are sketched (:func:`rows_to_sketch` on the point scores, with the
        degeneracy tolerance calibration uses, then the record's; every row with ``algorithm.use_kl_in_reward``, whose
        penalised scores are not known yet); the row mask goes to TransferQueue under
        :data:`SKETCH_ROWS_KEY` and into ``batch.fields`` (unless those are None, every field), so the workers and the Gram matrices read it
        (docs/sketch.md#skipped-rows)."""
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["uid", "response_mask", "rm_scores"])
        response_mask, scores = data["response_mask"], data["rm_scores"]
        if response_mask.is_nested:
            response_mask, scores = response_mask.to_padded_tensor(0), scores.to_padded_tensor(0.0)
        rtol = DEGENERATE_RTOL if self.record is None else self.record.degenerate_rtol
        if self.record is not None and self.config.algorithm.get("use_kl_in_reward", False):
            # the step scores rm_scores minus the KL penalty, which is not known yet: a group tied on rm_scores
            # may not be tied then, so every row is sketched
            rows = torch.ones(response_mask.shape[0], dtype=torch.bool)
        else:
            rows = rows_to_sketch(list(data["uid"]), response_mask, scores,
                                  int(self.config.actor_rollout_ref.rollout.n), rtol)
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                        fields=TensorDict({SKETCH_ROWS_KEY: rows}, batch_size=[len(rows)]))
        if batch.fields is not None:  # None selects every field, the mask included
            batch.fields = list(dict.fromkeys([*batch.fields, SKETCH_ROWS_KEY]))
        extra = {SKETCH_CONFIG_KEY: dataclasses.asdict(self.sketch_config)}
        extra["temperature"] = self.config.actor_rollout_ref.rollout.temperature
        if fused:  # the entropy verl's own old-log-prob pass reports, from the same logits
            extra["calculate_entropy"] = True
        sketch = self.setgrpo.sketch
        if sketch.max_token_len_per_gpu is not None:  # the sketch pass keeps activations for one backward
            extra.update(use_dynamic_bsz=True, max_token_len_per_gpu=int(sketch.max_token_len_per_gpu))
        elif sketch.micro_batch_size_per_gpu is not None:
            extra.update(use_dynamic_bsz=False, micro_batch_size_per_gpu=int(sketch.micro_batch_size_per_gpu))
        saved = {k: batch.extra_info[k] for k in extra if k in batch.extra_info}
        batch.extra_info.update(extra)
        try:
            rpc = self.actor_rollout_wg.compute_log_prob_and_sketches if fused else self.actor_rollout_wg.compute_sketches
            output = rpc(batch)
        finally:
            for k in extra:
                batch.extra_info.pop(k, None)
            batch.extra_info.update(saved)
        assert len(output) == len(batch)

    def _compute_old_log_prob(self, batch, metrics: dict):
        if self._reliability:  # no sketches: verl's own pass
            return super()._compute_old_log_prob(batch, metrics)
        rollout_corr = self.config.algorithm.get("rollout_correction", None)
        bypass = bool(rollout_corr and rollout_corr.get("bypass_mode", False))
        fused = self.setgrpo.sketch.fuse_old_log_prob and not bypass
        if not fused:  # verl's own old-log-prob pass (or rollout log-probs in bypass mode), then the sketch pass
            batch = super()._compute_old_log_prob(batch, metrics)
        t0 = time.perf_counter()
        with marked_timer("setgrpo_sketch", self.timing_raw, color="purple"):
            self._compute_sketches(batch, fused=fused)
        metrics["setgrpo/timing_s/sketch"] = time.perf_counter() - t0
        if fused:
            metrics["actor/entropy"] = self._entropy_metric(batch)
        if fused and self.config.actor_rollout_ref.rollout.calculate_log_probs:
            # the rollout-vs-actor log-prob diagnostics verl's own old-log-prob pass logs
            fields = ["old_log_probs", "response_mask", "responses", "rollout_log_probs"]
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
            metrics.update(calculate_debug_metrics(DataProto(batch=data.to_padded_tensor())))
        return batch

    def _entropy_metric(self, batch) -> float:
        """verl 0.9.1 ``_compute_old_log_prob``'s ``actor/entropy`` (v1 ``trainer_base``): the response entropies the
        fused pass wrote, aggregated with the actor's ``loss_agg_mode`` and ``loss_scale_factor``."""
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["entropy", "response_mask"])
        data = DataProto(batch=data.to_padded_tensor())
        actor = self.config.actor_rollout_ref.actor
        return agg_loss(loss_mat=data.batch["entropy"], loss_mask=data.batch["response_mask"],
                        loss_agg_mode=actor.loss_agg_mode, loss_scale_factor=actor.loss_scale_factor).detach().item()

    def _compute_advantage(self, batch, metrics: dict):
        """verl 0.9.1 ``PPOTrainer._compute_advantage`` (v1 ``trainer_base``) with :func:`compute_setgrpo_advantage`
        in place of its ``compute_advantage_for_multi_trajectories``, after reading the sketches, the sketched rows
        and the reference scores; tests/integration/test_estimator.py fingerprints the original."""
        key = self.setgrpo.reference_score_key
        fields = list(_ADV_FIELDS) + ["extra_fields"] + ([] if self._reliability else [SKETCH_KEY])
        fields += [k for k in (key, *GRADING_COUNT_KEYS) if batch.fields and k in batch.fields]
        fields += [] if self._reliability else sketch_rows_field(batch)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        sketches = None if self._reliability else dense_sketches(data.pop(SKETCH_KEY))
        sketched = None if self._reliability else sketched_rows(data)
        if sketched is not None:
            data.pop(SKETCH_ROWS_KEY)
        reference = reference_scores_from(data, key) if self.monitor is not None or self._reliability else None
        metrics.update(grading_metrics(data, batch.tags))
        for k in ("extra_fields", key, *GRADING_COUNT_KEYS):
            if k in data.keys():
                data.pop(k)

        response_mask = data["response_mask"]
        data = DataProto(batch=data.to_padded_tensor())
        data.batch["token_level_scores"] = data.batch["rm_scores"]
        data.non_tensor_batch["uid"] = np.array(data.batch.pop("uid").tolist(), dtype=object)

        if self.config.algorithm.use_kl_in_reward:
            data, kl_metrics = apply_kl_penalty(
                data, kl_ctrl=self.kl_ctrl_in_reward, kl_penalty=self.config.algorithm.kl_penalty
            )
            metrics.update(kl_metrics)
        else:
            data.batch["token_level_rewards"] = data.batch["token_level_scores"]

        rollout_corr_config = self.config.algorithm.get("rollout_correction", None)
        bypass = rollout_corr_config and rollout_corr_config.get("bypass_mode", False)
        rollout_correction = rollout_corr_config is not None and "rollout_log_probs" in data.batch and not bypass
        if rollout_correction:
            data, is_metrics = compute_rollout_correction_and_add_to_batch(data, rollout_corr_config)
            metrics.update(is_metrics)

        if self._reliability:
            step = reliability_step(data.batch["token_level_rewards"], data.batch["response_mask"],
                                    data.non_tensor_batch["uid"], reference, int(self.config.actor_rollout_ref.rollout.n),
                                    norm_by_std=bool(self.config.algorithm.get("norm_adv_by_std_in_grpo", True)),
                                    noise_scales=data.non_tensor_batch.get("noise_scale"))
            data.batch["advantages"] = data.batch["returns"] = step.advantages
            metrics.update(step.metrics)
            self._accepted_groups = int((step.weights > 0).sum())
        else:
            step = compute_setgrpo_advantage(data, sketches, self.record, reference_scores=reference,
                                             monitor=self.monitor, ablation=self.setgrpo.ablation,
                                             seed=self.setgrpo.seed + self.global_steps, sketched=sketched)
            metrics.update(step.metrics)
            self._accepted_groups = int(torch.as_tensor(step.result.accepted).sum())
        if self.setgrpo.group_log:
            if self._reliability:
                rows = _reliability_log_rows(step, self.global_steps)
            else:
                rows = _group_log_rows(step, self.global_steps)
            with open(os.path.expanduser(self.setgrpo.group_log), "a", encoding="utf-8") as fh:
                for row in rows:
                    fh.write(json.dumps(row) + "\n")

        out_fields = ["advantages", "returns"]
        if self.config.algorithm.use_kl_in_reward:
            out_fields.append("token_level_rewards")
        if rollout_correction:
            out_fields.append("response_mask")
            if "rollout_is_weights" in data.batch:
                out_fields.append("rollout_is_weights")
        output = TensorDict(
            {f: response_to_nested(data.batch[f], response_mask) for f in out_fields}, batch_size=len(batch)
        )
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=output)


    def _update_actor(self, batch, metrics: dict):
        """verl's actor update, skipped when no group was accepted: every coefficient is zero, so no optimizer step
        runs (AdamW's weight decay would otherwise still move the parameters) and ``actor/update_skipped`` is 1. The
        learning-rate scheduler still takes its step, as verl's update would, so that warmup and decay follow the
        step count (``actor/lr`` is logged as on an update)."""
        skipped = self._accepted_groups == 0
        metrics["actor/update_skipped"] = float(skipped)
        if skipped:
            logger.warning("SetGRPO step %d: no group accepted, no optimizer step", self.global_steps)
            metrics["actor/lr"] = float(self.actor_rollout_wg.step_lr_scheduler()[0])
            return batch
        return super()._update_actor(batch, metrics)


class _CalibrationDone(Exception):
    """Raised inside ``fit`` to stop after the calibration phase (``calibration.only=true``)."""
