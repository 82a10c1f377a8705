"""The calibration phase of the SetGRPO trainer mode (docs/algorithm.md#2-jrsc, #4-srgo, #7-record,
docs/record.md#calibration-shards): the calibration prompts rolled out with the initial policy, scored twice,
sketched, written one shard per batch, and the record built from the complete shard set.

:class:`CalibrationPhase` is a mixin of :class:`~setgrpo_verl.integration.trainer.SetGRPOTrainer`: it uses the
trainer's verl machinery (replay buffer, rollout, reward, sketch pass, checkpoint manager) and its record helpers
(``_record_out``, ``_run_identity``, ``_log_record``), and keeps no state of its own beyond the calibration
prompts' fingerprints. One batch's inputs by group come from :mod:`.calibration_groups`.
"""

from __future__ import annotations

import glob
import logging
import os
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Optional

import numpy as np
import transfer_queue as tq
from torchdata.stateful_dataloader import StatefulDataLoader
from tqdm import tqdm

from verl.trainer.ppo.utils import create_rl_dataset
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.rl_dataset import collate_fn

from setgrpo_verl.atomic import replace_durably
from setgrpo_verl.core import CalibrationRecord
from setgrpo_verl.core.record import package_versions, prompt_fingerprint
from setgrpo_verl.core.shards import (
    CalibrationShard,
    DROP_REASONS,
    in_part,
    load_shards,
    pilot_source,
    record_from_shards,
    SHARD_DIR,
    shard_identity,
    shard_name,
    shard_start_source,
    shard_versions,
    write_calibration,
    write_shard,
)
from setgrpo_verl.core.record_text import selection_text, table4_row

from .batch import sketch_rows_field
from .calibration_groups import CalibrationGroups, calibration_groups, calibration_sampling
from .config import TRUTH_SCORE_KEY
from .prompts import prompt_identity
from .grading_failures import GradingFailureBudget, all_failed_error, check_grading_failure_share
from .reward_config import CALIBRATION_MARK, GRADING_ERROR_KEY, grader_in_messages
from .reward_manager import (GRADING_COUNT_KEYS, TRUTH_VERDICTS_KEY, UNPARSED_RATIO_METRIC, grading_counts,
                             unparsed_ratio)
from .worker import SKETCH_KEY

logger = logging.getLogger(__name__)

__all__ = ["CalibrationGroups", "CalibrationPhase", "calibration_chunk_prompts", "calibration_groups",
           "calibration_sampling"]


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
        # a warning, so that the command line's progress bar opens with the first rollout, not the first shard
        logger.warning("SetGRPO calibration: %d groups so far (batch %d: %s)", self.groups, index, name)

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


class CalibrationPhase:
    """The calibration phase of :class:`~setgrpo_verl.integration.trainer.SetGRPOTrainer` (see the module
    docstring): ``_calibrate`` is its entry point."""

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
            tu.assign_non_tensor_data(batch, CALIBRATION_MARK, True)  # grading failures come back as rows, counted
            yield batch

    def _calibrate(self) -> Optional[CalibrationRecord]:
        """Calibration phase (docs/algorithm.md#2-jrsc, #4-srgo, #7-record, docs/record.md#calibration-shards):
        rollouts of the initial policy, two scorings, sketches, one shard per batch, then the record.

        The calibration batches are streamed: each chunk of ``calibration.chunk_batches`` batches (1 by default;
        fewer when :func:`calibration_chunk_prompts` limits what TransferQueue holds) is rolled out, the rollout
        sleeps (freeing its memory, as verl's sync trainer does before its actor passes), and each batch is scored,
        sketched and written at once to ``<record dir>/shards/`` (:func:`setgrpo_verl.core.shards.write_shard`). The
        policy does not change during calibration, so a further chunk wakes the rollout with one weight sync of the
        same weights; when training follows, one more sync wakes it for the first step.

        Batches that already have a shard (a stopped calibration, resumed) are not rolled out again: their shards
        are checked against this run's identity (refused, naming the file and field, when another run wrote them)
        and a torn file is renamed ``*.torn`` and its batch calibrated again; a shard the file system fails to read
        (an I/O error) stops the calibration, naming the file. With ``trainer.resume_mode=disable``
        existing shards are refused. With ``calibration.shard=I/N`` (N > 1) only every N-th batch from I is
        calibrated and no record is written (``setgrpo-verl merge-calibration`` builds it from all parts). Otherwise
        the record is built from the complete shard set read back from disk
        (:func:`setgrpo_verl.core.shards.record_from_shards`): the same record however the set was reached.

        verl's replay buffer samples the calibration prompts only (:func:`calibration_sampling`); a group that lost
        some of its K responses to a failed rollout session, or all of them, or one of whose responses could not be
        graded, is left out, and how many were left out for each reason goes to the tracker
        (``setgrpo/calibration/dropped_incomplete``, ``.../dropped_no_response``, ``.../dropped_grading_failed``),
        the log and ``paired_scores.npz`` (docs/verl_integration.md#partial-groups). Groups left out because grading
        failed are bounded by ``calibration.max_grading_failure_ratio`` (docs/record.md#grading-failures), checked
        as each batch comes in.

        Returns:
            The record, or None for a part of a sharded calibration.

        Raises:
            ValueError: an empty calibration set, a grader that gives the truth for some batches only, shards of
                another run or with another content, or shards left by an earlier run under
                ``trainer.resume_mode=disable``; more groups left out because grading failed, in the batches so
                far, than ``calibration.max_grading_failure_ratio`` allows the whole calibration
                (:func:`check_grading_failure_share`).
            RuntimeError: a sampled group whose prompt is not in the batch rolled out; a batch whose every group
                failed grading (:func:`all_failed_error`).
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
        identity = shard_identity(k=k, settings=settings, split_seed=cfg.calibration.split_seed,
                                  run=self._run_identity(), prompts=self._calibration_prompts,
                                  batch_size=len(batches[0][0]))
        source, provenance = self._shard_provenance(settings)
        done = self._existing_shards(shard_dir, identity, batches, provenance)
        part, parts = self._calibration_part(len(batches))
        todo = [b for b in range(len(batches)) if in_part(b, part, parts) and b not in done]
        logger.warning("SetGRPO calibration: %d batches of %d prompts in part %d/%d, %d with a shard already, %d to "
                       "calibrate; shards in %s", len(batches), len(self._calibration_prompts), part, parts,
                       sum(in_part(b, part, parts) for b in done), len(todo), shard_dir)
        progress = _Progress(len(todo), sum(len(batches[b][0]) for b in done))
        mine = {b: s for b, s in done.items() if in_part(b, part, parts)}
        budget = GradingFailureBudget(
            sum(len(batches[b][0]) for b in range(len(batches)) if in_part(b, part, parts)),
            float(cfg.calibration.max_grading_failure_ratio), grader_in_messages(self.config),
            sum(int(s.dropped.get("grading_failed", 0)) for s in mine.values()),
            [shard_name(b) for b, s in sorted(mine.items()) if s.dropped.get("grading_failed", 0)])
        asleep = self._calibrate_batches(shard_dir, batches, todo, identity, k, progress, provenance, budget)
        if parts > 1:
            self._finish_part(shard_dir, identity, part, parts, t0)
            return None
        record = self._write_record(shard_dir, identity, source, out, t0)
        if not cfg.calibration.only and asleep:  # training follows: verl's sync trainer starts with the rollout awake
            self.checkpoint_manager.update_weights(self.global_steps)
        return record

    def _shard_provenance(self, settings: Any) -> tuple[Optional[dict], dict]:
        """Where ``tau_start`` came from (the pilot's source, checked before any rollout, or None) and what every new
        shard records about how it was made: the running versions and that source (the pilot, or the user's own)."""
        cfg = self.setgrpo
        source = None
        if cfg.tau_start_pilot:
            path = os.path.expanduser(cfg.tau_start_pilot)
            source = pilot_source(CalibrationRecord.from_json(path), settings, self._calibration_prompts,
                                  name=f"algorithm.setgrpo.tau_start_pilot={path}")
        fixed = settings.srgo_procedure == "fixed_sequence"
        return source, {"package_versions": package_versions(),
                        "tau_start_source": source or ({"kind": "user"} if fixed else {})}

    def _calibration_part(self, n_batches: int) -> tuple[int, int]:
        """``calibration.shard``'s part I of N, refused when it holds none of the ``n_batches`` batches
        (check_run_config counts calibration.num_prompts; the files may hold fewer rows)."""
        cal = self.setgrpo.calibration
        part, parts = cal.part()
        if part >= n_batches:
            raise ValueError(f"algorithm.setgrpo.calibration.shard={cal.shard}: part {part} holds no "
                             f"batch, since the calibration prompts make {n_batches} batch(es): split it into at "
                             f"most {n_batches} parts")
        return part, parts

    def _finish_part(self, shard_dir: str, identity: dict, part: int, parts: int, t0: float) -> None:
        """End a part of a sharded calibration: its grading-failure share checked, no record (merge-calibration
        builds it from every part)."""
        if not self.setgrpo.calibration.only:  # check_run_config refuses this; a stopped part never trains
            raise RuntimeError("a part of a sharded calibration cannot train: calibration.only=true is needed")
        shards, _ = load_shards(shard_dir, identity)
        self._check_grading_share({b: s for b, s in shards.items() if in_part(b, part, parts)})
        logger.warning("SetGRPO calibration: part %d/%d finished in %.0f s; build the record from every part's "
                       "shard directory with `setgrpo-verl merge-calibration`", part, parts,
                       time.perf_counter() - t0)

    def _calibrate_batches(self, shard_dir: str, batches: list, todo: list[int], identity: dict, k: int,
                           progress: _Progress, provenance: dict, budget: GradingFailureBudget) -> bool:
        """Roll out, score, sketch and write the shard of each batch of ``todo``, a chunk of batches at a time: the
        rollout sleeps between a chunk's rollouts and its passes; each shard's failed groups are counted against
        ``budget``, which stops calibration at the first batch that puts its bound out of reach. Returns whether the
        rollout is asleep."""
        limit = calibration_chunk_prompts(self.config)
        asleep = False
        for chunk in _chunks(((b, *batches[b]) for b in todo), limit, self.setgrpo.calibration.chunk_batches):
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
                shard = self._calibration_shard(index, uids, batch, identity, k, progress, provenance)
                path = write_shard(shard_dir, shard)
                progress.shard_done(len(uids), os.path.basename(path))
                budget.add(shard.dropped["grading_failed"], os.path.basename(path))
        return asleep

    def _write_record(self, shard_dir: str, identity: dict, source: Optional[dict], out: str,
                      t0: float) -> CalibrationRecord:
        """The record of the complete shard set read back from disk, written to ``out`` with its paired scores; the
        groups left out, the unparsed verdicts and the record go to the log and the tracker."""
        shards, _ = load_shards(shard_dir, identity)
        self._check_grading_share(shards)
        record, paired = record_from_shards([(os.path.join(shard_dir, shard_name(b)), s) for b, s in shards.items()],
                                            tau_start_source=source)
        dropped = {reason: int(paired[f"dropped_{reason}"]) for reason in DROP_REASONS}
        if any(dropped.values()):
            logger.warning("SetGRPO calibration: %d of %d groups left out: %d lost some of their K responses (a "
                           "failed rollout session), %d came back with none, %d because grading failed",
                           sum(dropped.values()), len(self._calibration_prompts), dropped["incomplete"],
                           dropped["no_response"], dropped["grading_failed"])
        write_calibration(record, paired, out)
        grading = {f"setgrpo/calibration/dropped_{reason}": float(n) for reason, n in dropped.items()}
        if "judged_verdicts" in paired:
            grading[UNPARSED_RATIO_METRIC] = unparsed_ratio(float(paired["unparsed_verdicts"]),
                                                            float(paired["judged_verdicts"]))
        self._log_record(record, grading, timing_s=time.perf_counter() - t0)
        logger.warning("SetGRPO: calibration record written to %s: %s", out, table4_row(record))
        if record.tau_sel is None:
            logger.warning("SetGRPO: %s", selection_text(record))
        return record

    def _check_grading_share(self, shards: dict) -> None:
        """Refuse to finish when the groups of ``shards`` (batch index -> shard) left out because grading failed are
        more than ``calibration.max_grading_failure_ratio`` allows for their groups (:func:`check_grading_failure_share`)."""
        failed = {b: int(s.dropped.get("grading_failed", 0)) for b, s in sorted(shards.items())}
        if not any(failed.values()):  # only the dual reward manager fails grading; other managers have no grader
            return
        check_grading_failure_share(sum(failed.values()), sum(len(s.prompts) for s in shards.values()),
                                    float(self.setgrpo.calibration.max_grading_failure_ratio),
                                    grader_in_messages(self.config),
                                    [shard_name(b) for b, n in failed.items() if n])

    def _grading_failures(self, index: int, groups: CalibrationGroups) -> None:
        """Log the groups of calibration batch ``index`` left out because grading failed, naming the first error;
        stop when every group of the batch was (the judge is down: nothing of the batch could be calibrated).

        Raises:
            RuntimeError: :func:`all_failed_error`.
        """
        failed = groups.grading_failed
        if not failed:
            return
        first = next(iter(failed.values()))
        judge = grader_in_messages(self.config)
        if not groups.uids and not groups.incomplete:
            raise RuntimeError(all_failed_error(index, len(failed), judge, first))
        logger.warning("SetGRPO calibration: batch %d: %d group(s) left out because grading failed (%s; first: %s)",
                       index, len(failed), judge, first)

    def _existing_shards(self, shard_dir: str, identity: dict, batches: list, provenance: dict) -> dict:
        """The shards a stopped calibration left (batch index -> shard), each checked against this run's identity
        and its batch's prompts; torn files are renamed ``*.torn`` (kept for a look, never read) and calibrated
        again; stale temporary files are removed.

        Raises:
            ValueError: shards under ``trainer.resume_mode=disable``, of another run (file and field named),
                holding other prompts than their batch, or that the record would refuse with the new shards'
                ``provenance`` (another major.minor of setgrpo-verl or verl, another ``tau_start`` source:
                :func:`~setgrpo_verl.core.shards.shard_versions`, :func:`~setgrpo_verl.core.shards.shard_start_source`).
            OSError: a shard the file system failed to read (:func:`~setgrpo_verl.core.shards.read_shard`), file named.
        """
        if not os.path.isdir(shard_dir):
            return {}
        part, parts = self.setgrpo.calibration.part()
        for index in range(len(batches)):  # this part's writes that did not reach their rename (another part's
            if in_part(index, part, parts):  # writes into the same folder are left alone)
                for stale in glob.glob(os.path.join(glob.escape(shard_dir), f".{shard_name(index)}*.tmp")):
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
            replace_durably(path, aside)
        for index, shard in shards.items():
            if index >= len(batches) or list(shard.prompts) != self._calibration_prompts[
                    index * identity["prompts"]["batch_size"]:][:len(batches[index][0])]:
                raise ValueError(f"calibration shard {os.path.join(shard_dir, shard_name(index))}: field prompts "
                                 f"differs from calibration batch {index}'s prompts; delete the shards to calibrate "
                                 "again")
        # what the record would refuse once every batch is rolled out, refused before the first rollout
        paths = [(os.path.join(shard_dir, shard_name(i)), shard) for i, shard in sorted(shards.items())]
        shard_versions(paths, running=provenance["package_versions"])
        try:
            shard_start_source(paths, provenance["tau_start_source"])
        except ValueError as exc:
            raise ValueError(f"{exc}: set algorithm.setgrpo.tau_start_pilot as the stopped run had it, or delete the "
                             "shards to calibrate again") from None
        return shards

    def _calibration_shard(self, index: int, uids: list, batch: Any, identity: dict, k: int,
                           progress: "_Progress", provenance: dict) -> CalibrationShard:
        """Score and sketch one rolled-out calibration batch (its prompts' ``uids`` in order) and return its shard
        (groups in prompt order; ``provenance``: the package versions and ``tau_start`` source it records)."""
        key = self.setgrpo.reference_score_key
        metrics: dict = {}
        progress.phase("scoring", index)
        if self.reward_loop_manager.reward_loop_worker_handles is None:
            batch = self._compute_reward_colocate(batch, metrics=metrics)
        batch = self._balance_batch(batch, metrics=metrics)
        progress.phase("sketch", index)
        self._compute_sketches(batch)
        fields = ["uid", "response_mask", "rm_scores", "extra_fields", SKETCH_KEY]
        fields += [f for f in dict.fromkeys((key, TRUTH_SCORE_KEY, TRUTH_VERDICTS_KEY, GRADING_ERROR_KEY,
                                             *GRADING_COUNT_KEYS))
                   if batch.fields and f in batch.fields]
        fields += sketch_rows_field(batch)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        groups = calibration_groups(data, key, k=k)
        self._grading_failures(index, groups)
        position = {uid: i for i, uid in enumerate(uids)}
        outside = (set(groups.uids) | set(groups.incomplete) | set(groups.grading_failed)) - set(position)
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
            truth_verdicts=None if groups.truth_verdicts is None else groups.truth_verdicts[order],
            criterion_points=None if groups.criterion_points is None else groups.criterion_points[order],
            prompt_index=np.array([position[groups.uids[g]] for g in order], dtype=np.int64), identity=identity,
            dropped={"incomplete": len(groups.incomplete), "grading_failed": len(groups.grading_failed),
                     "no_response": n - len(groups.uids) - len(groups.incomplete) - len(groups.grading_failed)},
            verdicts=None if counts is None else tuple(float(c) for c in counts),
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **provenance,
        )
