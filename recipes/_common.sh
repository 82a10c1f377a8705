# Shared settings of the SetGRPO recipes (sourced by recipes/run.sh, which takes each model's row of
# recipes/models.tsv, and by recipes/smoke_qwen3_1gpu.sh; not run directly).
#
# The paper's training/rollout configuration (Table 3 of the SetGRPO paper): rollout group size K=8,
# max prompt length 2048, max response length 4096, batch size 64 prompts, mini-batch size 32 prompts,
# AdamW. The GRPO baseline uses exactly the same arguments with verl's stock `ppo_trainer` config and
# algorithm.adv_estimator=grpo.
#
# Environment (all optional):
#   PYTHON            python interpreter with verl[verl-core]==0.9.1 and setgrpo-verl installed (python3)
#   DATA_DIR          RubricHub parquet files from recipes/prepare_rubrichub.sh ($HOME/data/rubrichub)
#   RUN_ROOT          checkpoints and calibration records ($HOME/setgrpo_runs); with NNODES > 1 it must be on a file
#                     system every node mounts (NFS, Lustre, ...): a node-local one is refused before Ray
#                     (SETGRPO_SHARED_FS=1 if the check takes a shared one for local)
#   NNODES            nodes (1);  N_GPUS_PER_NODE  GPUs per node (8)
#   REWARD_MANAGER    verl reward-manager name of the dual (point + reference) rubric grader (setgrpo_dual)
#   JUDGE_BASE_URL    OpenAI-compatible endpoint of the rubric judge, e.g. a vLLM server (http://<judge host>:8000/v1);
#                     required, no default: the trainer takes every GPU of its nodes, so the judge runs elsewhere, and
#                     with NNODES > 1 a loopback URL (localhost, 127.0.0.1) is refused before Ray
#   JUDGE_MODEL       judge model name served there (Qwen/Qwen3-8B); the key is read from OPENAI_API_KEY where the
#                     recipe starts and reaches every reward worker through Ray's runtime environment (never the
#                     command line, the logs or the record)
#   JUDGE_TEMPERATURE judge sampling temperature (1.0: the stochastic grader SetGRPO calibrates)
#   JUDGE_CONTEXT     the judge server's context in tokens (32768; vLLM's --max-model-len): every response is cut to
#                     JUDGE_CONTEXT - 1024 UTF-8 bytes, an upper bound on its tokens, before the judge reads it, so
#                     that no request (response, question, criterion and verdict) outgrows the judge's context
#   LOGGER            verl trainer.logger list; default '["console","file","tensorboard"]' (metrics.jsonl and
#                     tensorboard/ in the run's directory, $RUN_ROOT/<run>), plus "wandb" when WANDB_API_KEY is set
#                     or `wandb login` stored a key in ~/.netrc (the key reaches verl's TaskRunner through Ray's runtime
#                     environment; wandb without a key is refused before Ray); set LOGGER to ask for wandb (or others)
#   SKETCH_TOKENS_PER_GPU  token budget of the sketch pass's micro-batches (6144 = one full-length sequence)
#   POLICY_THINKING   true | false (false): the policy's chat-template thinking (Qwen3, Qwen3.5: enable_thinking; other
#                     templates ignore it). With thinking on, the judge grades the answer after the </think> tag, and a
#                     response whose reasoning outruns data.max_response_length is graded as the empty answer
#                     (setgrpo/grading/no_answer_ratio; docs/grading.md#thinking-policies)
#   RECORD            calibration record (default: $RUN_ROOT/<model>-setgrpo-calibrate/setgrpo_calibration.json)
# Runs: <model>-setgrpo-calibrate (record only), <model>-setgrpo (training), <model>-grpo (baseline), in $RUN_ROOT.
# Extra arguments to the recipe after the mode are appended as Hydra overrides (the last value of a key wins).
# calibrate skips verl's validation before training (it trains nothing); pass trainer.val_before_train=true after
# the mode to run it anyway. train and grpo validate first.

set -euo pipefail

PYTHON=${PYTHON:-python3}
DATA_DIR=${DATA_DIR:-$HOME/data/rubrichub}
RUN_ROOT=${RUN_ROOT:-$HOME/setgrpo_runs}
NNODES=${NNODES:-1}
N_GPUS_PER_NODE=${N_GPUS_PER_NODE:-8}
REWARD_MANAGER=${REWARD_MANAGER:-setgrpo_dual}
LOGGER=${LOGGER:-}
JUDGE_BASE_URL=${JUDGE_BASE_URL:-}
JUDGE_MODEL=${JUDGE_MODEL:-Qwen/Qwen3-8B}
JUDGE_TEMPERATURE=${JUDGE_TEMPERATURE:-1.0}
JUDGE_CONTEXT=${JUDGE_CONTEXT:-32768}
SKETCH_TOKENS_PER_GPU=${SKETCH_TOKENS_PER_GPU:-6144}
POLICY_THINKING=${POLICY_THINKING:-false}

# The default logger list: what runs anywhere, plus wandb when a key is present (wandb.init fails without one, in
# verl's TaskRunner, after the models and vLLM are up).
_default_logger() {
    if [ -n "${WANDB_API_KEY:-}" ] || grep -qs "api.wandb.ai" "$HOME/.netrc"; then
        echo '["console","file","tensorboard","wandb"]'
    else
        echo '["console","file","tensorboard"]'
    fi
}

# Table 3 settings shared by SetGRPO and the GRPO baseline.
_table3_args() {
    echo "data.train_files=$DATA_DIR/train.parquet"
    echo "data.val_files=$DATA_DIR/test.parquet"
    echo "data.max_prompt_length=2048"
    echo "data.max_response_length=4096"
    echo "data.train_batch_size=64"
    echo "data.filter_overlong_prompts=true"
    echo "data.truncation=error"
    echo "actor_rollout_ref.rollout.n=8"
    echo "actor_rollout_ref.rollout.name=vllm"
    echo "actor_rollout_ref.rollout.tensor_model_parallel_size=$ROLLOUT_TP"
    echo "actor_rollout_ref.rollout.gpu_memory_utilization=0.6"
    echo "actor_rollout_ref.rollout.temperature=1.0"
    echo "actor_rollout_ref.actor.ppo_mini_batch_size=32"
    # FSDP2, the strategy the CPU tests run (tests/integration/test_fsdp_engine.py, the verl_cpu runs)
    echo "actor_rollout_ref.actor.strategy=fsdp2"
    echo "actor_rollout_ref.ref.strategy=fsdp2"
    echo "actor_rollout_ref.actor.optim.optimizer=AdamW"
    echo "actor_rollout_ref.actor.optim.lr=$LR"
    echo "actor_rollout_ref.actor.use_dynamic_bsz=true"
    echo "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$MAX_TOKENS_PER_GPU"
    echo "actor_rollout_ref.actor.use_kl_loss=false"
    echo "actor_rollout_ref.actor.entropy_coeff=0"
    echo "actor_rollout_ref.actor.loss_agg_mode=token-mean"
    echo "actor_rollout_ref.actor.fsdp_config.param_offload=$PARAM_OFFLOAD"
    echo "actor_rollout_ref.actor.fsdp_config.optimizer_offload=$PARAM_OFFLOAD"
    echo "actor_rollout_ref.model.path=$MODEL_PATH"
    # the policy's thinking, explicit (Qwen3's template thinks unless told not to); the grader reads the answer
    echo "+data.apply_chat_template_kwargs.enable_thinking=$POLICY_THINKING"
    echo "actor_rollout_ref.model.use_remove_padding=true"
    echo "actor_rollout_ref.model.enable_gradient_checkpointing=true"
    echo "algorithm.use_kl_in_reward=false"
    echo "algorithm.norm_adv_by_std_in_grpo=true"
    echo "reward.reward_manager.name=$REWARD_MANAGER"
    echo "reward.num_workers=8"
    echo "+reward.reward_kwargs.grader.type=openai"
    echo "+reward.reward_kwargs.grader.base_url=$JUDGE_BASE_URL"
    echo "+reward.reward_kwargs.grader.model=$JUDGE_MODEL"
    echo "+reward.reward_kwargs.grader.temperature=$JUDGE_TEMPERATURE"
    echo "+reward.reward_kwargs.grader.max_concurrency=64"
    echo "+reward.reward_kwargs.grader.max_response_tokens=$((JUDGE_CONTEXT - 1024))"
    # Qwen3 judges think before answering by default: switch thinking off so that a short verdict budget suffices
    echo "+reward.reward_kwargs.grader.chat_template_kwargs.enable_thinking=false"
    echo "trainer.logger=$LOGGER"
    echo "trainer.project_name=setgrpo"
    echo "trainer.nnodes=$NNODES"
    echo "trainer.n_gpus_per_node=$N_GPUS_PER_NODE"
    echo "trainer.total_training_steps=500"
    echo "trainer.save_freq=50"
    echo "trainer.test_freq=25"
    echo "trainer.val_before_train=true"
}

# run_recipe MODE [hydra overrides...]
#   MODE = calibrate | train | grpo | smoke (calibrate, then train, in one run: recipes/smoke_qwen3_1gpu.sh)
# Needs MODEL_TAG, MODEL_PATH, ROLLOUT_TP, LR, MAX_TOKENS_PER_GPU, PARAM_OFFLOAD (recipes/run.sh: a row of models.tsv).
run_recipe() {
    local mode=${1:-}
    if [ $# -gt 0 ]; then shift; fi
    local experiment="${MODEL_TAG}-${mode}"
    [ "$mode" = train ] && experiment="${MODEL_TAG}-setgrpo"
    [ "$mode" = calibrate ] && experiment="${MODEL_TAG}-setgrpo-calibrate"
    local record=${RECORD:-$RUN_ROOT/${MODEL_TAG}-setgrpo-calibrate/setgrpo_calibration.json}
    [ "$mode" = smoke ] && record=$RUN_ROOT/$experiment/setgrpo_calibration.json
    case "$mode" in
        calibrate|train|grpo|smoke) ;;
        *)
            echo "usage: $0 {calibrate|train|grpo} [hydra overrides...]" >&2
            exit 2
            ;;
    esac
    case "$POLICY_THINKING" in
        true|false) ;;
        *)
            echo "$0: POLICY_THINKING=$POLICY_THINKING: set true or false (recipes/_common.sh)" >&2
            exit 2
            ;;
    esac
    if [ -z "$JUDGE_BASE_URL" ]; then
        echo "$0: set JUDGE_BASE_URL to the rubric judge's OpenAI-compatible endpoint, e.g." \
             "JUDGE_BASE_URL=http://<judge host>:8000/v1 (recipes/_common.sh)" >&2
        exit 2
    fi
    LOGGER=${LOGGER:-$(_default_logger)}
    local -a args
    mapfile -t args < <(_table3_args)
    # verl's file and tensorboard loggers write into the run's directory, on whichever node verl's TaskRunner runs
    # (the Ray runtime environment reaches every node; verl's file logger does not create the folder)
    mkdir -p "$RUN_ROOT/$experiment"
    args+=("+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH=$RUN_ROOT/$experiment/metrics.jsonl"
           "+ray_kwargs.ray_init.runtime_env.env_vars.TENSORBOARD_DIR=$RUN_ROOT/$experiment/tensorboard")
    # shared by the calibrate and train runs (setgrpo_trainer already selects the estimator and trainer mode):
    # the paper's levels and the sketch budget
    local -a setgrpo_args=(
        algorithm.setgrpo.alpha=0.05 algorithm.setgrpo.beta=0.08 algorithm.setgrpo.delta=0.05
        algorithm.setgrpo.sketch.max_token_len_per_gpu="$SKETCH_TOKENS_PER_GPU"
    )
    case "$mode" in
        calibrate)
            # roll out the calibration prompts with the initial policy, score twice, sketch, write the record, stop
            exec "$PYTHON" -m verl.trainer.main_ppo --config-name setgrpo_trainer \
                "${args[@]}" \
                "${setgrpo_args[@]}" \
                trainer.val_before_train=false \
                algorithm.setgrpo.calibration.files="$DATA_DIR/calib.parquet" \
                algorithm.setgrpo.calibration.num_prompts=4096 \
                algorithm.setgrpo.calibration.only=true \
                algorithm.setgrpo.record_out="$record" \
                trainer.experiment_name="$experiment" \
                trainer.default_local_dir="$RUN_ROOT/$experiment" \
                "$@"
            ;;
        train)
            # SetGRPO training with the frozen record written by the calibrate run
            exec "$PYTHON" -m verl.trainer.main_ppo --config-name setgrpo_trainer \
                "${args[@]}" \
                "${setgrpo_args[@]}" \
                algorithm.setgrpo.record_path="$record" \
                trainer.experiment_name="$experiment" \
                trainer.default_local_dir="$RUN_ROOT/$experiment" \
                "$@"
            ;;
        smoke)
            # calibrate on the calibration prompts, write the record, then train with it, in one run
            exec "$PYTHON" -m verl.trainer.main_ppo --config-name setgrpo_trainer \
                "${args[@]}" \
                "${setgrpo_args[@]}" \
                algorithm.setgrpo.calibration.files="$DATA_DIR/calib.parquet" \
                algorithm.setgrpo.record_out="$record" \
                trainer.experiment_name="$experiment" \
                trainer.default_local_dir="$RUN_ROOT/$experiment" \
                "$@"
            ;;
        grpo)
            # the GRPO baseline: verl's stock config and estimator, identical Table 3 settings and the same
            # rubric-validating dataset class as setgrpo_trainer; setgrpo_trainer's check before Ray (grader,
            # attention kernels) as a Hydra callback, which verl's stock config lacks; one scoring per response
            # (GRPO reads no reference score) and verl's sync trainer that also logs the grading metrics
            exec "$PYTHON" -m verl.trainer.main_ppo \
                +hydra.callbacks.setgrpo_check._target_=setgrpo_verl.integration.run_check.SetGRPOConfigCheck \
                "${args[@]}" \
                algorithm.adv_estimator=grpo \
                +reward.reward_kwargs.scorings=1 \
                trainer.v1.trainer_mode=graded_sync \
                data.custom_cls.path=pkg://setgrpo_verl.grading.verl_dataset \
                data.custom_cls.name=RubricRLHFDataset \
                trainer.experiment_name="$experiment" \
                trainer.default_local_dir="$RUN_ROOT/$experiment" \
                "$@"
            ;;
    esac
}
