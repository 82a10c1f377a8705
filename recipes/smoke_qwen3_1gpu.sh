#!/usr/bin/env bash
# One-GPU smoke run of SetGRPO on Qwen/Qwen3-0.6B (verl 0.9.1): K=4, a few prompts, 3 training steps, vLLM rollout,
# FSDP2, the judge served on the same GPU. It calibrates (rollout, two scorings, sketches, the record), then trains
# with that record in the same run, so it passes through every part of a real run: vLLM's sleep and wake between
# rollout and training, the weight sync to the rollout, the sketch pass, the actor update. Minutes, not hours.
# It checks the plumbing, not the certificate: a few dozen calibration groups certify no threshold at the paper's
# levels, so the smoke trains with the fixed_threshold ablation (tau 0) and allows a record that certifies nothing.
# Not yet run on a GPU (composition tested: tests/integration/test_hydra_recipes.py).
#
# 1. Data: bash recipes/prepare_rubrichub.sh (CALIB_SIZE=64 is enough here).
# 2. The judge, on the same GPU, before this script (a quarter of its memory; thinking off in the requests):
#      vllm serve Qwen/Qwen3-0.6B --port 8001 --gpu-memory-utilization 0.25 --max-model-len 8192 &
#    wait until `curl -s http://127.0.0.1:8001/v1/models` answers. A loopback URL is allowed on one node.
# 3. JUDGE_BASE_URL=http://127.0.0.1:8001/v1 JUDGE_MODEL=Qwen/Qwen3-0.6B bash recipes/smoke_qwen3_1gpu.sh
#
# Environment: as recipes/_common.sh (JUDGE_CONTEXT defaults to 8192 here, the judge's --max-model-len).
# Anything after the script name is passed to Hydra.

MODEL_TAG=qwen3-0.6b
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-0.6B}
ROLLOUT_TP=1
LR=${LR:-1e-6}
# memory at the first actor update on a 24 GB card (docs/benchmarks.md#one-gpu-smoke-memory, measured on the CPU):
# judge 5.6 GiB + rollout residue ~1 + bf16 weights 1.1 + the pass's upper bound at 4,096 tokens 7.6-8.5 = 15.3-16.2
# of 22.35 GiB with FSDP parameter/optimizer offload; 8,192 tokens without offload would need 31-33 GiB (a 40 GB card)
MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-4096}
PARAM_OFFLOAD=${PARAM_OFFLOAD:-true}
N_GPUS_PER_NODE=1
NNODES=1
JUDGE_CONTEXT=${JUDGE_CONTEXT:-8192}
SKETCH_TOKENS_PER_GPU=${SKETCH_TOKENS_PER_GPU:-4096}

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
run_recipe smoke \
    actor_rollout_ref.rollout.n=4 \
    data.max_prompt_length=1024 \
    data.max_response_length=1024 \
    data.train_batch_size=8 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.35 \
    reward.num_workers=1 \
    reward.reward_kwargs.grader.max_concurrency=32 \
    algorithm.setgrpo.calibration.num_prompts=32 \
    algorithm.setgrpo.calibration.on_infeasible=reject_all \
    algorithm.setgrpo.ablation=fixed_threshold \
    algorithm.setgrpo.fixed_tau=0.0 \
    trainer.total_training_steps=3 \
    trainer.save_freq=-1 \
    trainer.test_freq=-1 \
    trainer.val_before_train=false \
    "$@"
