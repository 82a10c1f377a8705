#!/usr/bin/env bash
# SetGRPO recipes for verl 0.9.1 (1 node x 8 GPUs by default), one per model of recipes/models.tsv:
#
#   bash recipes/run.sh qwen3_4b calibrate   # calibration run: write the frozen record (algorithm.setgrpo.calibration.only=true)
#   bash recipes/run.sh qwen3_4b train       # SetGRPO training run with that record
#   bash recipes/run.sh qwen3_4b grpo        # GRPO baseline with identical settings (verl's stock config)
#
# Recipes: qwen3_4b, qwen3_14b, qwen3_5_4b, qwen3_5_9b, llama3_2_3b (recipes/models.tsv says what differs).
# Prepare the data first: bash recipes/prepare_rubrichub.sh. Environment variables: see recipes/_common.sh.
# Anything after the mode is passed to Hydra, e.g. trainer.total_training_steps=100.
set -euo pipefail

TABLE="$(dirname "${BASH_SOURCE[0]}")/models.tsv"
recipe=${1:-}
row=$(awk -v name="$recipe" '!/^#/ && $1 == name' "$TABLE")
if [ -z "$recipe" ] || [ -z "$row" ]; then
    echo "usage: $0 {$(awk '!/^#/ && NF {print $1}' "$TABLE" | paste -sd'|')} {calibrate|train|grpo}" \
         "[hydra overrides...] (recipes/models.tsv)" >&2
    exit 2
fi
shift
read -r _ MODEL_TAG path tp lr tokens offload <<<"$row"
MODEL_PATH=${MODEL_PATH:-$path}
ROLLOUT_TP=${ROLLOUT_TP:-$tp}
LR=${LR:-$lr}
MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-$tokens}
PARAM_OFFLOAD=${PARAM_OFFLOAD:-$offload}

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
run_recipe "$@"
