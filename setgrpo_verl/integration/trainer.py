"""The SetGRPO trainer mode for verl 0.9.1's v1 trainer (``trainer.v1.trainer_mode=setgrpo``).

:class:`SetGRPOTrainer` subclasses verl's ``PPOTrainerSync`` (registered with ``register_trainer``) and
changes exactly three things:

1. the actor worker is :class:`~setgrpo_verl.integration.worker.SetGRPOActorRolloutRefWorker` (sketch RPC);
2. after verl's old-log-prob pass every step fetches per-response gradient sketches (or, with
   ``algorithm.setgrpo.sketch.fuse_old_log_prob=true``, one fused pass gives both), and the advantage step
   hands verl's ``compute_advantage`` a :class:`~setgrpo_verl.integration.estimator.SetGRPOStepContext`
   (sketches + frozen record), so the registered ``setgrpo`` estimator writes
   ``advantages = coefficient * response_mask`` and verl's PPO loss runs unchanged;
3. before the first step it loads and validates ``algorithm.setgrpo.record_path`` or, when that is null,
   runs the calibration phase (docs/algorithm.md#2-jrsc, #4-srgo, #7-record): roll out the calibration prompts with the initial
   policy (the same sampling as training), read the point (``rm_scores``) and reference scores from the
   dual-reward manager, sketch, write one shard per batch (docs/record.md#calibration-shards) and build the
   record from the complete shard set; ``calibration.only=true`` stops there.

Every diagnostic of docs/algorithm.md#6-diagnostics goes to verl's tracker under ``setgrpo/``; with reference scores
present during training the online coverage / reversal monitor runs and warns on drift.

Internally the trainer reports ``trainer_mode == "sync"`` to verl's base class so that the replay buffer,
dataloader and checkpoint logic behave exactly as in the stock sync trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Iterator, NamedTuple, Optional

import numpy as np
import ray
import torch
import transfer_queue as tq
from tensordict import TensorDict
from torchdata.stateful_dataloader import StatefulDataLoader
from tqdm import tqdm

from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import apply_kl_penalty
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
from verl.trainer.ppo.utils import Role, create_rl_dataset
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.rl_dataset import collate_fn
from verl.utils.debug import marked_timer
from verl.utils.debug.metrics import calculate_debug_metrics
from verl.workers.utils.padding import response_to_nested

from setgrpo_verl.core import (DEGENERATE_RTOL, SHARD_DIR, CalibrationRecord, CalibrationShard, OnlineRiskMonitor,
                               degenerate_groups, in_part, load_shards, package_versions, pilot_source,
                               prompt_fingerprint, record_from_shards, shard_identity, shard_name, write_calibration,
                               write_shard)

from .config import SETGRPO_NAME, TRUTH_SCORE_KEY, SetGRPOConfig, check_record, check_run_config, run_identity
from .estimator import SetGRPOStep, SetGRPOStepContext, complete_group_rows, group_gram, rows_to_sketch
from .prompts import prompt_identity
from .resume import (check_state, metrics_file, read_history, read_state, record_out_path, resume_folder,
                     write_state)
from .reward_manager import (GRADING_COUNT_KEYS, UNPARSED_RATIO_METRIC, grading_counts, grading_metrics,
                             unparsed_ratio)
from .worker import SKETCH_CONFIG_KEY, SKETCH_KEY, SKETCH_ROWS_KEY, SetGRPOActorRolloutRefWorker

logger = logging.getLogger(__name__)

_ACTOR_ROLES = (Role.Actor, Role.ActorRollout, Role.ActorRolloutRef)
_ADV_FIELDS = ["uid", "response_mask", "rm_scores", "rollout_log_probs", "old_log_probs", "ref_log_prob", "values"]


def reference_scores_from(data: TensorDict | dict, key: str) -> Optional[torch.Tensor]:
    """Reference scores r' of a batch (docs/algorithm.md#0-notation) as float64 [B] (reward units), or None when the reward
    manager did not return them.

    Looks for a top-level field ``key`` (colocated reward path) and else for ``extra_fields[i]
    ["reward_extra_info"][key]`` (verl's streaming reward loop).

    Raises:
        ValueError: some rows carry the score and others do not, or a value is not a finite number.
    """
    values: Optional[list] = None
    if key in data.keys():
        values = list(data[key].tolist() if hasattr(data[key], "tolist") else data[key])
    elif "extra_fields" in data.keys():
        extra = data["extra_fields"]
        extra = extra.tolist() if hasattr(extra, "tolist") else list(extra)
        values = [(e or {}).get("reward_extra_info", {}).get(key) if isinstance(e, dict) else None for e in extra]
        if all(v is None for v in values):
            return None
    if values is None:
        return None
    if any(v is None for v in values):
        raise ValueError(
            f"score {key!r} of reward_extra_info is missing for {sum(v is None for v in values)} of {len(values)} "
            "responses"
        )
    out = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if not torch.isfinite(out).all():
        raise ValueError(f"score {key!r} of reward_extra_info contains NaN/inf")
    return out


def _dense(sketches: torch.Tensor) -> torch.Tensor:
    """TransferQueue returns per-sample tensors as a jagged nested tensor: stack them to float32 [B, m]."""
    if sketches.is_nested:
        rows = sketches.unbind()
        if len({int(r.numel()) for r in rows}) != 1:
            raise ValueError("sketch rows differ in length: actor ranks used different sketch settings")
        sketches = torch.stack(rows)
    return sketches.float()


def sketched_rows(data: TensorDict | dict) -> Optional[torch.Tensor]:
    """The rows the actor sketched (bool [B], :data:`SKETCH_ROWS_KEY`), or None when every row was sketched."""
    if SKETCH_ROWS_KEY not in data.keys():
        return None
    rows = data[SKETCH_ROWS_KEY]
    rows = torch.stack(rows.unbind()) if rows.is_nested else torch.as_tensor(rows)
    return rows.reshape(-1).to(torch.bool)


class CalibrationGroups(NamedTuple):
    """Calibration inputs of one batch, grouped by uid: float64 ``point [G, K]``, ``reference [G, K]``,
    ``gram [G, K, K]`` and ``truth [G, K]`` (noise-free scores, docs/validation.md#noisy-grader) or ``None``; the G
    complete groups' ``uids`` and ``incomplete``, each group left out for holding fewer than K responses -> its
    response count."""

    point: torch.Tensor
    reference: torch.Tensor
    gram: torch.Tensor
    truth: Optional[torch.Tensor]
    uids: list = []
    incomplete: dict = {}


@contextlib.contextmanager
def calibration_sampling(replay_buffer: Any) -> Iterator[None]:
    """Within the block, verl's sync ``ReplayBuffer`` samples the calibration prompts and nothing else
    (docs/verl_integration.md#partial-groups).

    verl 0.9.1's buffer replaces a wholly failed group (``trainer.v1.sampler.sync_refill_failed_groups=true``) and
    the groups its DAPO filter evicts (``algorithm.filter_groups``) through ``refill_fn``, which draws *training*
    prompts; both are off here, so a failed or filtered calibration group stays in the batch and calibration
    accounts for it. Any other call of ``refill_fn`` raises RuntimeError. Attributes the buffer lacks (a custom
    sampler) are left alone.
    """
    def refuse(count: int) -> int:
        raise RuntimeError(f"verl's replay buffer asked for {count} more prompts during calibration, which would be "
                           "training prompts: calibration samples only its own prompts")

    saved = {}
    for name, value in (("sync_refill_failed_groups", False), ("filter_groups_metric", None), ("refill_fn", refuse)):
        if hasattr(replay_buffer, name):
            saved[name] = getattr(replay_buffer, name)
            setattr(replay_buffer, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(replay_buffer, name, value)


def calibration_groups(data: TensorDict, reference_key: str, truth_key: str = TRUTH_SCORE_KEY, *,
                       k: int) -> CalibrationGroups:
    """Calibration inputs of one rolled-out, scored and sketched batch (docs/algorithm.md#2-jrsc, #4-srgo).

    Args:
        data: TransferQueue fields ``uid``, ``response_mask`` and ``rm_scores`` (nested [B, j]), ``setgrpo_sketch``
            ([B, m], dense or nested), the reference scores and, when the grader knows it, the truth (both read
            by :func:`reference_scores_from`).
        reference_key: ``algorithm.setgrpo.reference_score_key``.
        truth_key: key of the noise-free score in ``reward_extra_info``.
        k: ``actor_rollout_ref.rollout.n``; a group with fewer responses (a failed rollout session, which verl's
            agent loop keeps) is left out and counted in ``incomplete``
            (docs/verl_integration.md#partial-groups).

    Returns:
        :class:`CalibrationGroups` (float64, complete groups by uid, padding groups skipped; ``truth`` None when
        the batch carries none).

    Raises:
        ValueError: no reference scores (the run does not use the dual-reward manager), a group larger than
            ``k``, non-finite sketches, a truth for only some responses or a non-finite one.
    """
    reference = reference_scores_from(data, reference_key)
    if reference is None:
        raise ValueError(
            f"calibration needs a reference score per response under reward_extra_info[{reference_key!r}]: use "
            "the setgrpo dual-reward manager (reward.reward_manager.name) or set algorithm.setgrpo.reference_score_key"
        )
    response_mask, scores = data["response_mask"], data["rm_scores"]
    if response_mask.is_nested:
        response_mask, scores = response_mask.to_padded_tensor(0), scores.to_padded_tensor(0.0)
    groups, uids, incomplete = complete_group_rows(list(data["uid"]), response_mask, k)
    point = scores.to(torch.float64).sum(-1)[groups]
    truth = reference_scores_from(data, truth_key)
    sketched = sketched_rows(data)
    gram = group_gram(_dense(data[SKETCH_KEY]), groups, sketched) if uids else torch.zeros(0, k, k, dtype=torch.float64)
    if sketched is not None and uids:
        unread = ~sketched[groups].all(-1) & ~degenerate_groups(point)
        if unread.any():
            raise ValueError(f"{int(unread.sum())} calibration group(s) are not degenerate but were not sketched")
    return CalibrationGroups(point, reference[groups], gram, None if truth is None else truth[groups], uids,
                             incomplete)


def compute_setgrpo_advantage(
    data: DataProto,
    batch_keys: list[str],
    context: SetGRPOStepContext,
    *,
    num_repeat: int,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[DataProto, SetGRPOStep]:
    """Advantages of one training batch through verl's own advantage entry point (docs/algorithm.md#3-ggsr, #6-diagnostics).

    Calls ``verl.trainer.ppo.v1.utils.compute_advantage_for_multi_trajectories`` with
    ``adv_estimator="setgrpo"`` and ``config=context``, exactly as verl's v1 trainer does for its estimators.

    Args:
        data: DataProto with ``token_level_rewards`` [B, T], ``response_mask`` [B, T] and ``uid`` [B].
        batch_keys: the B TransferQueue keys ``{uid}_{session}_{index}`` (only used by verl for GRPO).
        context: the step's :class:`SetGRPOStepContext`.
        num_repeat: ``actor_rollout_ref.rollout.n``.

    Returns:
        ``(data with advantages/returns, SetGRPOStep)``.

    Raises:
        ValueError / RuntimeError: see :func:`setgrpo_verl.integration.estimator.setgrpo_step`.
    """
    data = compute_advantage_for_multi_trajectories(
        data,
        batch_keys=batch_keys,
        adv_estimator=SETGRPO_NAME,
        gamma=gamma,
        lam=lam,
        num_repeat=num_repeat,
        norm_adv_by_std_in_grpo=context.get("norm_adv_by_std_in_grpo", True),
        config=context,
    )
    if context.output is None:
        raise RuntimeError("the setgrpo estimator did not run (is the setgrpo_verl verl plugin loaded?)")
    return data, context.output


def calibration_chunk_prompts(config: Any) -> Optional[int]:
    """Most calibration prompts whose rollouts the calibration phase holds in TransferQueue at once, or None.

    The phase rolls out a chunk of calibration batches (``calibration.chunk_batches``) before it scores and
    sketches them (docs/verl_integration.md#trainer-mode), so all ``rollout.n`` responses of a chunk's prompts sit
    in TransferQueue together. verl's SimpleStorage backend refuses entries beyond
    ``transfer_queue.backend.SimpleStorage.total_storage_size`` (spread over its storage units by index); half
    of it is left for the uneven spread and other partitions.

    Args:
        config: the composed verl config.

    Returns:
        ``total_storage_size // (2 * rollout.n)`` (at least 1) for the SimpleStorage backend with a size; None
        (no limit) for an unlimited SimpleStorage or another backend.
    """
    backend = (config.get("transfer_queue") or {}).get("backend")
    if backend is None or backend.get("storage_backend", "SimpleStorage") != "SimpleStorage":
        return None
    size = (backend.get("SimpleStorage") or {}).get("total_storage_size")
    if size is None:
        return None
    return max(1, int(size) // (2 * int(config.actor_rollout_ref.rollout.n)))


def _chunks(batches, limit: Optional[int], most: int = 1):
    """Consecutive ``(index, batch)`` calibration batches grouped into lists of at most ``most`` batches and at most
    ``limit`` prompts (one batch at least)."""
    chunk, held = [], 0
    for item in batches:
        if chunk and (len(chunk) >= most or (limit is not None and held + len(item[1]) > limit)):
            yield chunk
            chunk, held = [], 0
        chunk.append(item)
        held += len(item[1])
    if chunk:
        yield chunk


def _sketch_rows_field(batch: Any) -> list[str]:
    """``[SKETCH_ROWS_KEY]`` when the sketch pass wrote the row mask for ``batch`` (its fields name it, or are None:
    every field), else ``[]``."""
    return [SKETCH_ROWS_KEY] if batch.fields is None or SKETCH_ROWS_KEY in batch.fields else []


def _free_name(path: str) -> str:
    """``path``, or ``path.1``, ``path.2``, ... : the first that does not exist (a torn shard set aside never
    replaces one set aside earlier)."""
    candidate, n = path, 0
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}.{n}"
    return candidate


class _Progress:
    """Progress of the calibration phase in the log: the phase of each batch (rollout, scoring, sketch) and, per
    shard written, the groups so far (the line the command line's progress bar counts) with the ETA."""

    def __init__(self, batches: int, groups_done: int):
        self.total, self.done, self.groups = batches, 0, groups_done
        self.t0 = time.perf_counter()
        self.bar = tqdm(total=batches, desc="SetGRPO calibration", unit="batch", mininterval=5.0,
                        disable=batches == 0)

    def phase(self, name: str, index: int) -> None:
        self.bar.set_postfix_str(f"batch {index}: {name}")
        logger.info("SetGRPO calibration: batch %d: %s", index, name)

    def shard_done(self, groups: int, name: str) -> None:
        self.done += 1
        self.groups += groups
        self.bar.update(1)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        logger.warning("SetGRPO calibration: %d groups so far (%s written, %d of %d batches, %.0f s, ETA %.0f s)",
                       self.groups, name, self.done, self.total, elapsed, eta)
        if self.done == self.total:
            self.bar.close()


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


@register_trainer(SETGRPO_NAME)
class SetGRPOTrainer(PPOTrainerSync):
    """verl sync PPO trainer with SetGRPO calibration, sketches and gated advantages (see module docstring).

    Raises (at construction):
        ValueError: ``algorithm.adv_estimator`` is not ``setgrpo``, ``rollout.n < 2``, a critic is configured,
            or the ``algorithm.setgrpo`` block is missing / invalid.
    """

    # verl's base class branches on ``trainer_mode == "sync"`` (replay buffer, refill, checkpoint restore):
    # SetGRPO is a sync trainer, so that is what the base class sees.
    @property
    def trainer_mode(self) -> str:
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        if value != SETGRPO_NAME:
            raise ValueError(f"SetGRPOTrainer needs trainer.v1.trainer_mode={SETGRPO_NAME}, got {value!r}")

    def __init__(self, config):
        self.setgrpo: SetGRPOConfig = check_run_config(config)
        self.sketch_config = self.setgrpo.sketch.to_sketch_config()
        self.record: Optional[CalibrationRecord] = None
        self.monitor: Optional[OnlineRiskMonitor] = None
        self._accepted_groups: Optional[int] = None
        self._record_sha256: Optional[str] = None
        self._history: list[bytes] = []
        super().__init__(config)
        if self.use_critic:
            raise ValueError("SetGRPO is critic-free (outcome-level estimator): remove the critic configuration")

    # ------------------------------------------------------------------ workers
    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        for role in _ACTOR_ROLES:
            if role in self.role_worker_mapping:
                self.role_worker_mapping[role] = ray.remote(SetGRPOActorRolloutRefWorker)

    # ------------------------------------------------------------------ record
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
        self.record, loaded = self._load_or_calibrate(resumed=resumed)
        if self.record is None:  # a part of a sharded calibration: its shards are written, there is no record
            raise _CalibrationDone(os.path.join(os.path.dirname(os.path.abspath(self._record_out())), SHARD_DIR))
        self._record_sha256 = self.record.to_dict()["content_sha256"]
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
            logger.warning("SetGRPO: loaded calibration record %s: %s", record_path, record.table4_row())
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
        """On resume from checkpoint ``folder``: check its record hash, continue the monitor, cut the group log back
        to the checkpoint's step and give verl's metrics file back its rows up to that step; True when restored.

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
        file_logger = getattr(getattr(self, "logger", None), "logger", {}).get("file")
        history = getattr(self, "_history", [])
        if file_logger is not None and history:
            # verl's file logger truncated the file when it opened it (verl 0.9.1 FileLogger: open(path, "wb"))
            file_logger.fp.write(b"".join(history))
        logger.warning("SetGRPO: resumed after step %d: record sha256 %s, monitor %s, %d metric rows kept", step,
                       self._record_sha256, None if self.monitor is None else self.monitor.state_dict(),
                       len(history))
        return True

    def fit(self, agent_loop_manager):
        if self.global_steps > 0:  # resumed by verl's _load_checkpoint: keep the metrics history up to that step
            self._history = read_history(metrics_file(self.config), self.global_steps)
        try:
            return super().fit(agent_loop_manager)
        except _CalibrationDone as done:
            logger.warning("SetGRPO: calibration.only=true - written to %s, stopping before training", done)
            self._shutdown_dump_executor()

    # ------------------------------------------------------------------ calibration phase
    def _calibration_batches(self):
        cal = self.setgrpo.calibration
        files = cal.files if cal.files is not None else self.config.data.train_files
        dataset = create_rl_dataset(
            files, self.config.data, self.tokenizer, self.processor, is_train=True, max_samples=cal.num_prompts
        )
        loader = StatefulDataLoader(
            dataset=dataset,
            batch_size=cal.batch_size or self.config.data.train_batch_size,
            num_workers=self.config.data["dataloader_num_workers"],
            shuffle=False,
            drop_last=False,
            collate_fn=collate_fn,
        )
        for batch_dict in loader:
            # what the record is calibrated on: one fingerprint per calibration prompt, in rollout order
            n = len(batch_dict["raw_prompt"])
            columns = [batch_dict.get(key, [None] * n) for key in ("reward_model", "extra_info", "raw_prompt")]
            self._calibration_prompts += [prompt_fingerprint(*prompt_identity(*row)) for row in zip(*columns)]
            batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch_dict["raw_prompt"]))], dtype=object)
            batch = tu.get_tensordict(batch_dict)
            tu.assign_non_tensor_data(batch, "global_steps", self.global_steps)
            yield batch

    def _calibrate(self) -> Optional[CalibrationRecord]:
        """Calibration phase (docs/algorithm.md#2-jrsc, #4-srgo, #7-record, docs/record.md#calibration-shards):
        rollouts of the initial policy, two scorings, sketches, one shard per batch, then the record.

        The calibration batches are streamed: each chunk of ``calibration.chunk_batches`` batches (1 by default;
        fewer when :func:`calibration_chunk_prompts` limits what TransferQueue holds) is rolled out, the rollout
        sleeps (freeing its memory, as verl's sync trainer does before its actor passes), and each batch is scored,
        sketched and written at once to ``<record dir>/shards/`` (:func:`setgrpo_verl.core.write_shard`). The policy
        does not change during calibration, so a further chunk wakes the rollout with one weight sync of the same
        weights; when training follows, one more sync wakes it for the first step.

        Batches that already have a shard (a stopped calibration, resumed) are not rolled out again: their shards
        are checked against this run's identity (refused, naming the file and field, when another run wrote them)
        and a torn file is renamed ``*.torn`` and its batch calibrated again. With ``trainer.resume_mode=disable``
        existing shards are refused. With ``calibration.shard=I/N`` (N > 1) only every N-th batch from I is
        calibrated and no record is written (``setgrpo-verl merge-calibration`` builds it from all parts). Otherwise
        the record is built from the complete shard set read back from disk
        (:func:`setgrpo_verl.core.record_from_shards`): the same record however the set was reached.

        verl's replay buffer samples the calibration prompts only (:func:`calibration_sampling`); a group that lost
        some of its K responses to a failed rollout session, or all of them, is left out, and how many were left
        out for each reason goes to the tracker (``setgrpo/calibration/dropped_incomplete`` and
        ``.../dropped_no_response``), the log and ``paired_scores.npz`` (docs/verl_integration.md#partial-groups).

        Returns:
            The record, or None for a part of a sharded calibration.

        Raises:
            ValueError: an empty calibration set, a grader that gives the truth for some batches only, shards of
                another run or with another content, or shards left by an earlier run under
                ``trainer.resume_mode=disable``.
            RuntimeError: a sampled group whose prompt is not in the batch rolled out.
        """
        cfg = self.setgrpo
        k = int(self.config.actor_rollout_ref.rollout.n)
        self._calibration_prompts: list[dict] = []
        t0 = time.perf_counter()
        batches = [(list(b["uid"]), b) for b in self._calibration_batches()]
        if not batches:
            raise ValueError("the calibration prompt set is empty (algorithm.setgrpo.calibration.files / num_prompts)")
        out = self._record_out()
        folder = os.path.dirname(os.path.abspath(out))
        shard_dir = os.path.join(folder, SHARD_DIR)
        norm_by_std = bool(self.config.algorithm.get("norm_adv_by_std_in_grpo", True))
        settings = cfg.calibration_settings(norm_by_std=norm_by_std)
        identity = shard_identity(k=k, settings=settings.to_dict(), split_seed=cfg.calibration.split_seed,
                                  run=self._run_identity(), prompts=self._calibration_prompts,
                                  batch_size=len(batches[0][0]))
        source = None  # where tau_start came from, checked before any rollout
        if cfg.tau_start_pilot:
            path = os.path.expanduser(cfg.tau_start_pilot)
            source = pilot_source(CalibrationRecord.from_json(path), identity["settings"], self._calibration_prompts,
                                  name=f"algorithm.setgrpo.tau_start_pilot={path}")
        done = self._existing_shards(shard_dir, identity, batches)
        part, parts = cfg.calibration.part()
        todo = [b for b in range(len(batches)) if in_part(b, part, parts) and b not in done]
        logger.warning("SetGRPO calibration: %d batches of %d prompts in part %d/%d, %d with a shard already, %d to "
                       "calibrate; shards in %s", len(batches), len(self._calibration_prompts), part, parts,
                       sum(in_part(b, part, parts) for b in done), len(todo), shard_dir)
        progress = _Progress(len(todo), sum(len(batches[b][0]) for b in done))
        limit = calibration_chunk_prompts(self.config)
        asleep = False
        for chunk in _chunks(((b, *batches[b]) for b in todo), limit, cfg.calibration.chunk_batches):
            if asleep:  # the rollout slept through the previous chunk's passes: wake it, same weights
                self.checkpoint_manager.update_weights(self.global_steps)
            rollouts = []
            for index, uids, prompts in chunk:
                progress.phase("rollout", index)
                self._submit_batch_to_rollout(prompts)
                with calibration_sampling(self.replay_buffer):
                    batch, _ = self.replay_buffer.sample(
                        global_steps=self.global_steps, partition_id="train", batch_size=len(prompts)
                    )
                rollouts.append((index, uids, batch))
            self.on_sample_end()
            asleep = True
            for index, uids, batch in rollouts:
                shard = self._calibration_shard(index, uids, batch, identity, k, progress, tau_start_source=source)
                path = write_shard(shard_dir, shard)
                progress.shard_done(len(uids), os.path.basename(path))
        if parts > 1:
            if not cfg.calibration.only:  # check_run_config refuses this; a stopped part never trains
                raise RuntimeError("a part of a sharded calibration cannot train: calibration.only=true is needed")
            logger.warning("SetGRPO calibration: part %d/%d finished in %.0f s; build the record from every part's "
                           "shard directory with `setgrpo-verl merge-calibration`", part, parts,
                           time.perf_counter() - t0)
            return None
        shards, _ = load_shards(shard_dir, identity)
        record, paired = record_from_shards([(os.path.join(shard_dir, shard_name(b)), s) for b, s in shards.items()],
                                            tau_start_source=source)
        dropped = {reason: int(paired[f"dropped_{reason}"]) for reason in ("incomplete", "no_response")}
        if any(dropped.values()):
            logger.warning("SetGRPO calibration: %d of %d groups left out: %d lost some of their K responses (a "
                           "failed rollout session), %d came back with none", sum(dropped.values()),
                           len(self._calibration_prompts), dropped["incomplete"], dropped["no_response"])
        write_calibration(record, paired, out)
        grading = {f"setgrpo/calibration/dropped_{reason}": float(n) for reason, n in dropped.items()}
        if "judged_verdicts" in paired:
            grading[UNPARSED_RATIO_METRIC] = unparsed_ratio(float(paired["unparsed_verdicts"]),
                                                            float(paired["judged_verdicts"]))
        self._log_record(record, grading, timing_s=time.perf_counter() - t0)
        logger.warning("SetGRPO: calibration record written to %s: %s", out, record.table4_row())
        if record.tau_sel is None:
            logger.warning("SetGRPO: %s", record.selection_text())
        if not cfg.calibration.only and asleep:  # training follows: verl's sync trainer starts with the rollout awake
            self.checkpoint_manager.update_weights(self.global_steps)
        return record

    def _existing_shards(self, shard_dir: str, identity: dict, batches: list) -> dict:
        """The shards a stopped calibration left (batch index -> shard), each checked against this run's identity
        and its batch's prompts; torn files are renamed ``*.torn`` (kept for a look, never read) and calibrated
        again; stale temporary files are removed.

        Raises:
            ValueError: shards under ``trainer.resume_mode=disable``, of another run (file and field named), or
                holding other prompts than their batch.
        """
        if not os.path.isdir(shard_dir):
            return {}
        part, parts = self.setgrpo.calibration.part()
        for index in range(len(batches)):  # this part's writes that did not reach their rename (another part's
            if in_part(index, part, parts):  # writes into the same folder are left alone)
                stale = os.path.join(shard_dir, f".{shard_name(index)}.tmp")
                if os.path.isfile(stale):
                    os.remove(stale)
        if not any(n.endswith(".npz") for n in os.listdir(shard_dir)):
            return {}
        if str(self.config.trainer.get("resume_mode", "auto")) == "disable":
            raise ValueError(f"{shard_dir} holds calibration shards of an earlier run and trainer.resume_mode=disable: "
                             "set trainer.resume_mode=auto to continue that calibration, or delete the shards to "
                             "start it over")
        shards, torn = load_shards(shard_dir, identity, torn="skip")
        for path in torn:
            aside = _free_name(f"{path}.torn")
            logger.warning("SetGRPO calibration: %s cannot be read whole (a write cut off): renamed to %s, its batch "
                           "is calibrated again", path, os.path.basename(aside))
            os.replace(path, aside)
        for index, shard in shards.items():
            if index >= len(batches) or list(shard.prompts) != self._calibration_prompts[
                    index * identity["prompts"]["batch_size"]:][:len(batches[index][0])]:
                raise ValueError(f"calibration shard {os.path.join(shard_dir, shard_name(index))}: field prompts "
                                 f"differs from calibration batch {index}'s prompts; delete the shards to calibrate "
                                 "again")
        return shards

    def _calibration_shard(self, index: int, uids: list, batch: Any, identity: dict, k: int,
                           progress: "_Progress", *, tau_start_source: Optional[dict]) -> CalibrationShard:
        """Score and sketch one rolled-out calibration batch (its prompts' ``uids`` in order) and return its shard
        (groups in prompt order; ``tau_start_source``: the pilot a fixed sequence starts from, None: the user)."""
        key = self.setgrpo.reference_score_key
        metrics: dict = {}
        progress.phase("scoring", index)
        if self.reward_loop_manager.reward_loop_worker_handles is None:
            batch = self._compute_reward_colocate(batch, metrics=metrics)
        batch = self._balance_batch(batch, metrics=metrics)
        progress.phase("sketch", index)
        self._compute_sketches(batch)
        fields = ["uid", "response_mask", "rm_scores", "extra_fields", SKETCH_KEY]
        fields += [f for f in (key, TRUTH_SCORE_KEY, *GRADING_COUNT_KEYS) if batch.fields and f in batch.fields]
        fields += _sketch_rows_field(batch)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        groups = calibration_groups(data, key, k=k)
        position = {uid: i for i, uid in enumerate(uids)}
        outside = (set(groups.uids) | set(groups.incomplete)) - set(position)
        if outside:
            raise RuntimeError(f"calibration sampled {len(outside)} group(s) of prompts outside the batch it rolled "
                               "out")
        counts = grading_counts(data, batch.tags)
        tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
        order = sorted(range(len(groups.uids)), key=lambda g: position[groups.uids[g]])
        n = len(uids)
        size = identity["prompts"]["batch_size"]
        return CalibrationShard(
            index=index, prompts=tuple(self._calibration_prompts[index * size:index * size + n]),
            point=groups.point[order].numpy(), reference=groups.reference[order].numpy(),
            gram=groups.gram[order].numpy(), truth=None if groups.truth is None else groups.truth[order].numpy(),
            prompt_index=np.array([position[groups.uids[g]] for g in order], dtype=np.int64), identity=identity,
            dropped={"incomplete": len(groups.incomplete),
                     "no_response": n - len(groups.uids) - len(groups.incomplete)},
            verdicts=None if counts is None else tuple(float(c) for c in counts),
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            package_versions=package_versions(), tau_start_source=dict(tau_start_source or {}),
        )

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
        batch.fields = list(dict.fromkeys([*(batch.fields or []), "rm_scores", *written]))
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
        rollout_corr = self.config.algorithm.get("rollout_correction", None)
        bypass = bool(rollout_corr and rollout_corr.get("bypass_mode", False))
        fused = self.setgrpo.sketch.fuse_old_log_prob and not bypass
        if not fused:  # verl's own old-log-prob pass (or rollout log-probs in bypass mode), then the sketch pass
            batch = super()._compute_old_log_prob(batch, metrics)
        t0 = time.perf_counter()
        with marked_timer("setgrpo_sketch", self.timing_raw, color="purple"):
            self._compute_sketches(batch, fused=fused)
        metrics["setgrpo/timing_s/sketch"] = time.perf_counter() - t0
        if fused and self.config.actor_rollout_ref.rollout.calculate_log_probs:
            # the rollout-vs-actor log-prob diagnostics verl's own old-log-prob pass logs
            fields = ["old_log_probs", "response_mask", "responses", "rollout_log_probs"]
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
            metrics.update(calculate_debug_metrics(DataProto(batch=data.to_padded_tensor())))
        return batch

    def _compute_advantage(self, batch, metrics: dict):
        """verl's v1 ``_compute_advantage`` with the SetGRPO context (sketches, record, reference scores)."""
        key = self.setgrpo.reference_score_key
        fields = list(_ADV_FIELDS) + [SKETCH_KEY, "extra_fields"]
        fields += [k for k in (key, *GRADING_COUNT_KEYS) if batch.fields and k in batch.fields]
        fields += _sketch_rows_field(batch)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        sketches = _dense(data.pop(SKETCH_KEY))
        sketched = sketched_rows(data)
        if sketched is not None:
            data.pop(SKETCH_ROWS_KEY)
        reference = reference_scores_from(data, key) if self.monitor is not None else None
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

        context = SetGRPOStepContext(
            self.config.algorithm,
            sketches,
            self.record,
            reference_scores=reference,
            monitor=self.monitor,
            ablation=self.setgrpo.ablation,
            seed=self.setgrpo.seed + self.global_steps,
            sketched=sketched,
        )
        data, step = compute_setgrpo_advantage(
            data,
            batch.keys,
            context,
            num_repeat=self.config.actor_rollout_ref.rollout.n,
            gamma=self.config.algorithm.gamma,
            lam=self.config.algorithm.lam,
        )
        metrics.update(step.metrics)
        self._accepted_groups = int(torch.as_tensor(step.result.accepted).sum())
        if self.setgrpo.group_log:
            with open(os.path.expanduser(self.setgrpo.group_log), "a", encoding="utf-8") as fh:
                for row in _group_log_rows(step, self.global_steps):
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
        runs (AdamW's weight decay would otherwise still move the parameters) and ``actor/update_skipped`` is 1."""
        skipped = self._accepted_groups == 0
        metrics["actor/update_skipped"] = float(skipped)
        if skipped:
            logger.warning("SetGRPO step %d: no group accepted, no optimizer step", self.global_steps)
            return batch
        return super()._update_actor(batch, metrics)


class _CalibrationDone(Exception):
    """Raised inside ``fit`` to stop after the calibration phase (``calibration.only=true``)."""
