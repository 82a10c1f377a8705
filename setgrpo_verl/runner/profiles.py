"""The command line's configuration flags and named presets (profiles) of :mod:`setgrpo_verl.runner.cli`.

A leaf module: the commands (:mod:`.cli`, :mod:`.compare`) read :data:`FLAGS` and :data:`PROFILES` and the config
values a parsed command line sets (:func:`overrides_from_args`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

__all__ = ["FLAGS", "MAIN_JOB_FLIP_PROB", "PROFILES", "default_profile", "flag_dest", "overrides_from_args", "profile_help"]


def _float_list(text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


#: Command-line flags and the config key each one sets: ``(flag, key, type, help)``; a help of None means the key's
#: own field doc from :class:`setgrpo_verl.integration.config.SetGRPOConfig`.
FLAGS: tuple[tuple[str, str, Callable[[str], Any], str | None], ...] = (
    ("--alpha", "algorithm.setgrpo.alpha", float, None),
    ("--beta", "algorithm.setgrpo.beta", float, None),
    ("--delta", "algorithm.setgrpo.delta", float, None),
    ("--tau-grid", "algorithm.setgrpo.tau_grid", _float_list, None),
    ("--rho", "algorithm.setgrpo.rho", float, None),
    ("--calib-groups", "algorithm.setgrpo.calibration.num_prompts", int, None),
    ("--calib-batch-size", "algorithm.setgrpo.calibration.batch_size", int, None),
    ("--split-seed", "algorithm.setgrpo.calibration.split_seed", int, None),
    ("--on-infeasible", "algorithm.setgrpo.calibration.on_infeasible", str, None),
    ("--ablation", "algorithm.setgrpo.ablation", str, None),
    ("--fixed-tau", "algorithm.setgrpo.fixed_tau", float, None),
    ("--rollout-n", "actor_rollout_ref.rollout.n", int, "K, responses per prompt (verl: actor_rollout_ref.rollout.n)"),
    ("--groups-per-step", "data.train_batch_size", int, "prompts (groups) per training step (verl: data.train_batch_size)"),
    ("--steps", "trainer.total_training_steps", int, "training steps (verl: trainer.total_training_steps)"),
    ("--max-prompt-length", "data.max_prompt_length", int, "prompt tokens; longer prompts are dropped"),
    ("--max-response-length", "data.max_response_length", int, "new tokens per response"),
    ("--temperature", "actor_rollout_ref.rollout.temperature", float, "sampling temperature of the rollouts"),
    ("--top-p", "actor_rollout_ref.rollout.top_p", float, "nucleus sampling of the rollouts"),
    ("--lr", "actor_rollout_ref.actor.optim.lr", float, "actor learning rate (AdamW)"),
    ("--clip-ratio", "actor_rollout_ref.actor.clip_ratio", float, "PPO clip ratio"),
    ("--entropy-coeff", "actor_rollout_ref.actor.entropy_coeff", float, "entropy bonus"),
    ("--loss-agg-mode", "actor_rollout_ref.actor.loss_agg_mode", str, "verl's loss aggregation (token-mean, ...)"),
    ("--seed", "data.seed", int, "seed of the data split and verl's dataloader"),
)

#: The noisy rules grader's flip rate of the main job (``quickstart`` with ``--judge rules``, its default): every
#: rule verdict flips with this probability in each scoring. The noisiest rate at which SetGRPO still trains most
#: groups at the ``default`` profile's levels (the paper's regime, NUR about 70 %) with a calibration that fits the
#: main job's time, and the outcome comparison's rate (docs/cli.md#quickstart has the plan).
MAIN_JOB_FLIP_PROB = 0.06

#: Named presets: values of the keys above (and of verl keys without a flag). ``default`` is the main job on 2 CPU
#: cores: the validation rubrics and the noisy rules grader, whose truth is known (the profile of every command
#: with ``--judge rules``); ``judge`` is the same job with the embedded LLM judge on the IFBench prompts (the profile
#: of every other judge); ``smoke`` is the plumbing check of the end-to-end test; ``validate`` is ``setgrpo-verl
#: validate`` on the composite validation rubrics at the tightest levels its 240 groups certify
#: (docs/validation.md#profiles). Flags and ``key=value`` arguments win. Measured times: docs/benchmarks.md.
PROFILES: dict[str, dict[str, Any]] = {
    "default": {
        "actor_rollout_ref.rollout.n": 4,
        "data.train_batch_size": 4,
        "trainer.total_training_steps": 3,
        # every validation rubric fits 128 prompt tokens
        "data.max_prompt_length": 128,
        "data.max_response_length": 24,
        # sized by the sample-size plan at flip 0.06 (docs/cli.md#quickstart): a fresh run certifies a threshold
        # with probability about 0.9 or more; each batch is its own chunk, so that progress shows batch by batch
        "algorithm.setgrpo.calibration.num_prompts": 128,
        "algorithm.setgrpo.calibration.batch_size": 32,
        "algorithm.setgrpo.alpha": 0.2,
        "algorithm.setgrpo.beta": 0.3,
        # at delta 0.05 one run's 64 risk groups leave the fresh-run certify estimate below 0.9
        "algorithm.setgrpo.delta": 0.1,
        # four thresholds: the risk test runs at delta / 4, and tau 0 is the one that certifies at this noise
        "algorithm.setgrpo.tau_grid": [0.0, 0.2, 0.4, 0.6],
        # a run that certifies no threshold says so and trains no group instead of stopping
        "algorithm.setgrpo.calibration.on_infeasible": "reject_all",
        "actor_rollout_ref.actor.optim.lr": 1e-5,
        # a checkpoint every 5 steps and after the last (the latest kept): --resume continues an interrupted training
        # having lost at most 4 finished steps; a checkpoint (about 1.5 GiB: float32 weights and AdamW's moments)
        # costs 2-5 s, 12-20 % of a step, when written after every step
        "trainer.save_freq": 5,
        "trainer.max_actor_ckpt_to_keep": 1,
    },
    "judge": {
        "actor_rollout_ref.rollout.n": 4,
        "data.train_batch_size": 4,
        "trainer.total_training_steps": 3,
        "data.max_prompt_length": 96,
        "data.max_response_length": 24,
        # sized for the risk test: 96 groups leave about 48 risk groups, enough for a threshold to certify at
        # these levels in most calibrations; three batches rolled out together keep the one weight sync of a
        # single chunk
        "algorithm.setgrpo.calibration.num_prompts": 96,
        "algorithm.setgrpo.calibration.batch_size": 32,
        "algorithm.setgrpo.calibration.chunk_batches": 3,
        # loose: the embedded judge is nearly a coin flip
        "algorithm.setgrpo.alpha": 0.5,
        "algorithm.setgrpo.beta": 0.65,
        "algorithm.setgrpo.delta": 0.2,
        "algorithm.setgrpo.tau_grid": [0.0, 0.2, 0.4, 0.6],
        "algorithm.setgrpo.calibration.on_infeasible": "reject_all",
        "actor_rollout_ref.actor.optim.lr": 1e-5,
        "trainer.save_freq": 5,
        "trainer.max_actor_ckpt_to_keep": 1,
    },
    "smoke": {
        "actor_rollout_ref.rollout.n": 3,
        "data.train_batch_size": 3,
        "trainer.total_training_steps": 2,
        "data.max_prompt_length": 80,
        "data.max_response_length": 12,
        "algorithm.setgrpo.calibration.num_prompts": 12,
        "algorithm.setgrpo.calibration.batch_size": 12,
        "algorithm.setgrpo.alpha": 0.5,
        "algorithm.setgrpo.beta": 0.95,
        "algorithm.setgrpo.delta": 0.3,
        "algorithm.setgrpo.tau_grid": [0.0, 0.3, 0.6],
        "algorithm.setgrpo.calibration.on_infeasible": "reject_all",
        "actor_rollout_ref.actor.optim.lr": 1e-5,
    },
    "validate": {
        "actor_rollout_ref.rollout.n": 4,
        "data.train_batch_size": 4,
        "data.max_prompt_length": 128,
        # the length at which the validation rubrics' instruction types were measured
        "data.max_response_length": 48,
        "algorithm.setgrpo.calibration.num_prompts": 240,
        "algorithm.setgrpo.calibration.batch_size": 16,
        # small sketch micro-batches bound the actor worker's peak memory, so that Ray's memory monitor does not
        # kill it on a small shared machine
        "algorithm.setgrpo.sketch.micro_batch_size_per_gpu": 4,
        # the tightest levels that 240 groups certify in (nearly) every split (docs/validation.md#profiles)
        "algorithm.setgrpo.alpha": 0.2,
        "algorithm.setgrpo.beta": 0.3,
        "algorithm.setgrpo.delta": 0.05,
    },
}
#: ``validate`` at the paper's levels (alpha 0.05, beta 0.08, delta 0.05, the 20 default thresholds), sized from the
#: sample-size plan of the validate profile's stage: 16,000 groups (needs ``--data`` with more rows than the
#: embedded 3,000, docs/validation.md#profiles).
PROFILES["paper"] = {
    **PROFILES["validate"],
    "algorithm.setgrpo.calibration.num_prompts": 16_000,
    "algorithm.setgrpo.alpha": 0.05,
    "algorithm.setgrpo.beta": 0.08,
    "algorithm.setgrpo.delta": 0.05,
}


def _profile_levels(name: str) -> str:
    """A profile's levels and calibration size for ``--help``, e.g. ``alpha 0.5, beta 0.65, delta 0.2, 96 groups``."""
    values = PROFILES[name]
    levels = ", ".join(f"{k} {values[f'algorithm.setgrpo.{k}']:g}" for k in ("alpha", "beta", "delta"))
    return f"{levels}, {values['algorithm.setgrpo.calibration.num_prompts']:,} calibration groups"


#: ``compare`` (docs/outcome.md#through-verl-the-plan): the pilot's policy settings (K 4, 8 groups a step, 48 new
#: tokens, lr 2e-5) and the paper's procedure at the ``validate`` profile's levels, which its 240 calibration groups
#: certify in (nearly) every split; a checkpoint at every validation (``--val-every``), the latest kept.
PROFILES["compare"] = {
    **PROFILES["validate"],
    "data.train_batch_size": 8,
    "trainer.total_training_steps": 100,
    "actor_rollout_ref.actor.optim.lr": 2e-5,
    "trainer.max_actor_ckpt_to_keep": 1,
}

#: What each profile is, for ``--profile``'s help (its levels and calibration size are added).
_PROFILE_TEXT = {
    "default": "the main job on 2 CPU cores, the profile of --judge rules",
    "judge": "the main job with an LLM judge, the profile of every other --judge",
    "smoke": "a plumbing check",
    "validate": "validate at the tightest levels it certifies in about 23 minutes on 2 CPU cores",
    "paper": "validate at the paper's levels, about 24 hours",
    "compare": "the outcome comparison's policy and calibration sizes",
}


def default_profile(judge: str) -> str:
    """The profile of a command that names none: ``default`` with ``--judge rules``, ``judge`` with any other judge."""
    return "default" if judge == "rules" else "judge"


def profile_help(default: str | None) -> str:
    """``--profile``'s help text: every profile with what it is, its levels and calibration size; ``default`` None
    means :func:`default_profile`'s choice."""
    parts = [f"'{name}' ({_PROFILE_TEXT[name]}; {_profile_levels(name)})" for name in PROFILES]
    chosen = default or "'default' with --judge rules, 'judge' otherwise"
    return f"preset sizes (default {chosen}): " + ", ".join(parts)


def flag_dest(flag: str) -> str:
    """The argparse attribute of a flag: ``--flip-prob`` -> ``flip_prob``."""
    return flag.lstrip("-").replace("-", "_")


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Config keys and values of a parsed command line: the profile, then the flags (a flag wins).

    Raises:
        LaunchError: an invalid value (the message names the flag).
    """
    from .launch import LaunchError

    args.profile = args.profile or default_profile(args.judge)
    values = dict(PROFILES[args.profile])
    for flag, key, _, _ in FLAGS:
        value = getattr(args, flag_dest(flag), None)
        if value is not None:
            values[key] = value
    if args.actor_ranks < 1:
        raise LaunchError(f"--actor-ranks {args.actor_ranks}: need at least one actor rank")
    if args.judge == "openai" and not (args.judge_base_url and args.judge_model):
        raise LaunchError("--judge openai needs --judge-base-url and --judge-model")
    if args.judge != "openai" and (args.judge_max_tokens is not None or args.judge_chat_template_kwargs
                                   or args.judge_max_concurrency is not None):
        raise LaunchError("--judge-max-tokens, --judge-chat-template-kwargs and --judge-max-concurrency apply to "
                          "--judge openai only")
    for flag, value in (("--judge-max-tokens", args.judge_max_tokens),
                        ("--judge-max-concurrency", args.judge_max_concurrency)):
        if value is not None and value < 1:
            raise LaunchError(f"{flag} {value}: must be a positive integer")
    if args.judge_max_response_tokens is not None:
        if args.judge not in ("openai", "local"):
            raise LaunchError("--judge-max-response-tokens applies to --judge openai or local only")
        if args.judge_max_response_tokens < 1:
            raise LaunchError(f"--judge-max-response-tokens {args.judge_max_response_tokens}: must be a positive "
                              "integer")
    if args.judge == "rules" and (args.judge_model or args.judge_base_url or args.judge_temperature is not None):
        raise LaunchError("--judge rules checks rule criteria by code: it takes no --judge-model, --judge-base-url or "
                          "--judge-temperature")
    if args.flip_prob is not None:
        from ..grading.noisy import check_flip_prob

        try:
            check_flip_prob(args.flip_prob)
        except ValueError:
            raise LaunchError(f"--flip-prob {args.flip_prob}: must be in [0, 1)") from None
    if args.noise_seed is not None and args.flip_prob is None:
        raise LaunchError("--noise-seed seeds the noisy grader: give --flip-prob too")
    if (args.judge == "function") != (args.reward_function is not None):
        raise LaunchError("--reward-function FILE goes with --judge function (and --judge function needs it)")
    if args.reward_function is not None and not Path(args.reward_function.partition(":")[0]).expanduser().is_file():
        raise LaunchError(f"--reward-function {args.reward_function}: no such file")
    if values.get("actor_rollout_ref.rollout.n", 2) < 2:
        raise LaunchError("--rollout-n must be >= 2: groups need at least two responses")
    return values
