"""The sketch pass's fixed micro-batch against the batches a rank gets (docs/sketch.md#supported-settings): verl pads a
step's batch to a multiple of its ranks and mini-batch, and a micro-batch that does not divide a rank's share fails
inside the sketch pass, after the rollout."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

__all__ = ["check_sketch_micro_batch", "padded_batch_multiple", "sketch_micro_batch_error"]


def sketch_micro_batch_error(*, k: int, prompts: Mapping[str, int], ranks: int, micro: int,
                             source: str, multiple: int = 1) -> Optional[str]:
    """Why a fixed sketch micro-batch cannot split the batches a rank sees, or None (docs/sketch.md).

    verl's ``prepare_micro_batches`` (used by the sketch pass) needs every rank's share of a batch to be a multiple
    of the micro-batch size; a batch of ``p`` prompts is ``p * k`` responses, padded by verl's ``_balance_batch``
    up to a multiple of ``multiple`` (:func:`padded_batch_multiple`), over ``ranks`` data-parallel ranks,
    ``ceil(responses / ranks)`` on the fullest rank when they do not split evenly.

    Args:
        k: responses per prompt (``actor_rollout_ref.rollout.n``).
        prompts: a description of each batch (e.g. ``"a training step (data.train_batch_size=4)"``) -> its prompts.
        ranks: data-parallel actor ranks.
        micro: the fixed micro-batch size, in responses per rank.
        source: the key that set ``micro`` (named in the message).
        multiple: verl pads every batch to a multiple of this many responses (1: no padding).

    Returns:
        None when every batch splits evenly, else the message naming the batch, the sizes and the fix.
    """
    for what, count in prompts.items():
        if count < 1:
            continue
        responses = -(-int(count) * int(k) // multiple) * multiple
        per_rank = -(-responses // ranks)  # the fullest rank's share
        if per_rank % micro:
            fits = max(d for d in range(1, min(micro, per_rank) + 1) if per_rank % d == 0)
            padded = f", padded to {responses}" if responses != count * k else ""
            return (f"{source}={micro} does not divide the {per_rank} responses that each of the {ranks} actor "
                    f"rank(s) gets in {what} ({count} prompts x actor_rollout_ref.rollout.n={k}{padded}): verl's "
                    f"micro-batching needs equal chunks; use a divisor of {per_rank} (e.g. {fits}), null, or batch "
                    "sizes that are multiples of it")
    return None


def padded_batch_multiple(*, ranks: int, mini_batch_prompts: int, k: int) -> int:
    """The multiple of responses verl 0.9.1's ``_balance_batch`` pads every batch to with copies tagged
    ``is_padding`` (``PPOTrainer._get_required_batch_multiple`` without a critic): ``lcm(ranks,
    actor.ppo_mini_batch_size * k)``."""
    return math.lcm(int(ranks), int(mini_batch_prompts) * int(k))


def check_sketch_micro_batch(config: Any, setgrpo: Any) -> None:
    """Refuse, before Ray, a fixed micro-batch of the sketch pass that does not divide the batches a rank sees.

    The sketch pass uses ``algorithm.setgrpo.sketch.micro_batch_size_per_gpu`` or, when neither it nor
    ``max_token_len_per_gpu`` is set and verl's dynamic batching is off, the actor's
    ``actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu`` (docs/sketch.md). The batches are a training
    step (``data.train_batch_size`` prompts; not for a calibration-only run) and, when the run calibrates, the
    calibration batches (``calibration.batch_size`` prompts and the last, smaller one of ``calibration.num_prompts``).

    Raises:
        ValueError: naming the micro-batch key, the batch and the sizes (:func:`sketch_micro_batch_error`).
    """
    sketch = setgrpo.sketch
    if sketch.max_token_len_per_gpu is not None:
        return
    micro, source = sketch.micro_batch_size_per_gpu, "algorithm.setgrpo.sketch.micro_batch_size_per_gpu"
    arr = config.actor_rollout_ref
    if micro is None:
        if arr.actor.get("use_dynamic_bsz", False):
            return
        micro = arr.rollout.get("log_prob_micro_batch_size_per_gpu", None)
        source = ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu (the sketch pass's micro-batch when "
                  "algorithm.setgrpo.sketch.micro_batch_size_per_gpu is null)")
        if micro is None:
            return
    ranks = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    ranks //= max(1, int(arr.actor.get("ulysses_sequence_parallel_size", 1) or 1))
    train = int(config.data.train_batch_size)
    batches: dict[str, int] = {}
    if not setgrpo.calibration.only:
        batches[f"a training step (data.train_batch_size={train})"] = train
    if not setgrpo.record_path:
        cal = setgrpo.calibration
        size = int(cal.batch_size or train)
        batches[f"a calibration batch (algorithm.setgrpo.calibration.batch_size={size})"] = min(size, cal.num_prompts)
        if cal.num_prompts > size and cal.num_prompts % size:
            batches[f"the last calibration batch ({cal.num_prompts} calibration prompts in batches of {size})"] = (
                cal.num_prompts % size)
    # verl refuses a mini-batch larger than a step's prompts; at most those are padded to
    mini = min(int(arr.actor.get("ppo_mini_batch_size", train) or train), train)
    multiple = padded_batch_multiple(ranks=max(ranks, 1), k=int(arr.rollout.n), mini_batch_prompts=mini)
    error = sketch_micro_batch_error(k=int(arr.rollout.n), prompts=batches, ranks=max(ranks, 1), micro=int(micro),
                                     source=source, multiple=multiple)
    if error:
        raise ValueError(error)
