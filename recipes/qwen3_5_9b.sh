#!/usr/bin/env bash
# SetGRPO recipe for Qwen/Qwen3.5-9B (verl 0.9.1, 1 node x 8 GPUs).
#
#   bash recipes/qwen3_5_9b.sh calibrate   # calibration run: write the frozen record (algorithm.setgrpo.calibration.only=true)
#   bash recipes/qwen3_5_9b.sh train       # SetGRPO training run with that record
#   bash recipes/qwen3_5_9b.sh grpo        # GRPO baseline with identical settings (verl's stock config)
#
# Prepare the data first: bash recipes/prepare_rubrichub.sh. Environment variables: see recipes/_common.sh.
# Anything after the mode is passed to Hydra, e.g. trainer.total_training_steps=100.

MODEL_TAG=qwen3.5-9b
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3.5-9B}
ROLLOUT_TP=${ROLLOUT_TP:-2}
LR=${LR:-1e-6}
MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-12288}
PARAM_OFFLOAD=${PARAM_OFFLOAD:-false}

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
run_recipe "$@"
