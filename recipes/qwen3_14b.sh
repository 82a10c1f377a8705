#!/usr/bin/env bash
# SetGRPO recipe for Qwen/Qwen3-14B (verl 0.9.1, 1 node x 8 GPUs, FSDP parameter/optimizer offload).
#
#   bash recipes/qwen3_14b.sh calibrate   # calibration run: write the frozen record (algorithm.setgrpo.calibration.only=true)
#   bash recipes/qwen3_14b.sh train       # SetGRPO training run with that record
#   bash recipes/qwen3_14b.sh grpo        # GRPO baseline with identical settings (verl's stock config)
#
# Prepare the data first: bash recipes/prepare_rubrichub.sh. Environment variables: see recipes/_common.sh.
# Anything after the mode is passed to Hydra, e.g. trainer.total_training_steps=100.

MODEL_TAG=qwen3-14b
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-14B}
ROLLOUT_TP=${ROLLOUT_TP:-4}
LR=${LR:-5e-7}
MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-8192}
PARAM_OFFLOAD=${PARAM_OFFLOAD:-true}

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
run_recipe "$@"
