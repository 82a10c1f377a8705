"""Hydra composition of setgrpo_trainer.yaml and of every recipe, through verl's own `main_ppo --cfg job`."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.machinery
import io
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

import verl.trainer.main_ppo as main_ppo
from verl.utils.config import omega_conf_to_dataclass

import setgrpo_verl
from setgrpo_verl.integration.config import SetGRPOAlgoConfig, SetGRPOConfig, setgrpo_config_from
from setgrpo_verl.integration.run_check import check_run_config
from setgrpo_verl.models import embedded_model_dir

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "recipes" / "run.sh"
#: The model recipes: the first column of recipes/models.tsv (bash recipes/run.sh <recipe> <mode>).
RECIPES = [line.split()[0] for line in (REPO / "recipes" / "models.tsv").read_text().splitlines()
           if line.strip() and not line.startswith("#")]
SMOKE = REPO / "recipes" / "smoke_qwen3_1gpu.sh"
MODES = ("calibrate", "train", "grpo")
JUDGE = "http://judge.internal:8000/v1"  # the recipes have no default judge URL
CONFIG_DIR = str(REPO / "hydra_configs")  # the YAML sources (installed as the package setgrpo_verl.hydra_configs)
TABLE3 = {  # the paper's Table 3, as verl keys
    "actor_rollout_ref.rollout.n": 8,
    "data.max_prompt_length": 2048,
    "data.max_response_length": 4096,
    "data.train_batch_size": 64,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 32,
    "actor_rollout_ref.actor.optim.optimizer": "AdamW",
}


def _compose(argv: list[str]) -> tuple[int, str, str]:
    """Run verl's Hydra entry point `main_ppo.main` with `argv + --cfg job` in this process."""
    old = sys.argv
    sys.argv = ["main_ppo", *argv, "--cfg", "job"]
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main_ppo.main()
    except SystemExit as exc:
        code = int(exc.code or 0)
    finally:
        sys.argv = old
    return code, out.getvalue(), err.getvalue()


def _name(recipe) -> str:
    """A model recipe's name (a line of models.tsv), or a script's stem (the smoke recipe)."""
    return recipe if isinstance(recipe, str) else recipe.stem


def _command(recipe) -> list[str]:
    return ["bash", str(RUN), recipe] if isinstance(recipe, str) else ["bash", str(recipe)]


def _recipe_argv(recipe: Path, mode: str | None, tmp: Path, *extra: str, environ: dict | None = None) -> list[str]:
    """The exact arguments a recipe passes to `python -m verl.trainer.main_ppo` (captured by a python shim)."""
    shim, captured = tmp / "python", tmp / f"{_name(recipe)}-{mode}.args"
    shim.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = "-m" ] && [ "$2" = "verl.trainer.main_ppo" ]; then shift 2; printf "%s\\0" "$@" > "$SHIM_OUT"; '
        "exit 0; fi\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    shim.chmod(0o755)
    env = {"JUDGE_BASE_URL": JUDGE, "RUN_ROOT": str(tmp / "runs"), **os.environ, "PYTHON": str(shim),
           "SHIM_OUT": str(captured), "HOME": str(tmp)}
    env.pop("WANDB_API_KEY", None)
    env.update(environ or {})
    subprocess.run([*_command(recipe), *([mode] if mode else []), *extra], env=env, check=True, capture_output=True,
                   timeout=120)
    return captured.read_text().split("\0")[:-1]


@pytest.fixture(scope="module")
def compositions(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recipes")
    out = {}
    for recipe in RECIPES:
        for mode in MODES:
            argv = _recipe_argv(recipe, mode, tmp)
            code, stdout, stderr = _compose(argv)
            assert code == 0, f"{recipe} {mode}: Hydra composition failed:\n{stderr[-3000:]}"
            out[recipe, mode] = (argv, OmegaConf.create(stdout))
    return out


def test_the_recipe_table_has_one_line_per_model_and_run_sh_refuses_others(tmp_path):
    """recipes/models.tsv holds what differs between the model recipes; run.sh takes its rows and nothing else."""
    rows = [line.split() for line in (REPO / "recipes" / "models.tsv").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert all(len(row) == 7 for row in rows) and len({row[0] for row in rows}) == len(rows)
    assert not [p.name for p in (REPO / "recipes").glob("*.sh")
                if p.stem in RECIPES]  # no per-model script beside the table
    argv = _recipe_argv("qwen3_14b", "train", tmp_path)
    for expected in ("actor_rollout_ref.model.path=Qwen/Qwen3-14B", "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
                     "actor_rollout_ref.actor.optim.lr=5e-7", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192",
                     "actor_rollout_ref.actor.fsdp_config.param_offload=true"):
        assert expected in argv, expected
    assert "actor_rollout_ref.actor.optim.lr=2e-6" in _recipe_argv("qwen3_14b", "train", tmp_path, environ={"LR": "2e-6"})
    proc = subprocess.run(["bash", str(RUN), "qwen3_40b", "train"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage:" in proc.stderr and "qwen3_4b|qwen3_14b|" in proc.stderr, proc.stderr


def test_every_target_model_has_a_recipe():
    assert set(RECIPES) == {"qwen3_4b", "qwen3_14b", "qwen3_5_4b", "qwen3_5_9b", "llama3_2_3b"}
    assert (REPO / "recipes" / "prepare_rubrichub.sh").exists()


@pytest.mark.slow
def test_every_recipe_composes(compositions, monkeypatch):
    from setgrpo_verl.integration import support

    # the recipes name hub models, which this offline test cannot read: the policy's parameter layout is then
    # checked on the workers, as for a remote path (tests/integration/test_support.py covers the layout check)
    monkeypatch.setattr(support, "build_meta_policy", lambda model_cfg: None)
    # nor can it fingerprint their files for the record's identity (tests/integration/test_run_identity.py does)
    from setgrpo_verl.integration import run_check

    monkeypatch.setattr(run_check, "run_identity", lambda cfg, setgrpo: {})
    # the recipes load the policy with verl's default attention, flash_attention_2: its package (flash_attn, the
    # gpu extra) stands in here, and tests/integration/test_pre_ray_checks.py covers its refusal when missing
    spec = importlib.machinery.ModuleSpec("flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn", SimpleNamespace(__spec__=spec))
    assert len(compositions) == len(RECIPES) * len(MODES)
    for (name, mode), (argv, cfg) in compositions.items():
        assert "attn_implementation" not in cfg.actor_rollout_ref.model.override_config, (name, mode)
        for key, value in TABLE3.items():
            assert OmegaConf.select(cfg, key) == value, (name, mode, key)
        # calibration trains nothing: no validation pass before it (train and grpo validate the initial policy)
        assert cfg.trainer.val_before_train is (mode != "calibrate"), (name, mode)
        assert cfg.reward.reward_manager.name == "setgrpo_dual" and cfg.reward.reward_kwargs.grader.type == "openai"
        # responses cut to fit a 32,768-token judge context with the question, criterion and verdict
        assert cfg.reward.reward_kwargs.grader.max_response_tokens == 32768 - 1024, (name, mode)
        if mode != "train":  # the pre-Ray check passes (train needs the record file the calibrate run writes)
            check_run_config(cfg)
        if mode == "grpo":
            assert cfg.algorithm.adv_estimator == "grpo" and cfg.trainer.v1.trainer_mode == "graded_sync"
            assert cfg.reward.reward_kwargs.scorings == 1  # GRPO reads no reference score
            assert "setgrpo" not in cfg.algorithm and "--config-path" not in argv  # verl's stock config
            assert ("+hydra.callbacks.setgrpo_check._target_=setgrpo_verl.integration.run_check.SetGRPOConfigCheck"
                    in argv)  # with the check before Ray
            continue
        assert "scorings" not in cfg.reward.reward_kwargs  # SetGRPO: the default two
        assert cfg.algorithm.adv_estimator == "setgrpo" and cfg.trainer.v1.trainer_mode == "setgrpo"
        setgrpo = setgrpo_config_from(cfg.algorithm)
        assert (setgrpo.alpha, setgrpo.beta, setgrpo.delta) == (0.05, 0.08, 0.05)
        assert isinstance(omega_conf_to_dataclass(cfg.algorithm), SetGRPOAlgoConfig)  # verl's own conversion
        if mode == "calibrate":
            assert setgrpo.calibration.only and setgrpo.record_path is None and setgrpo.record_out
            assert setgrpo.calibration.files.endswith("calib.parquet")
        else:
            assert not setgrpo.calibration.only and setgrpo.record_path.endswith("setgrpo_calibration.json")


def test_calibrate_validates_first_only_when_asked(tmp_path):
    recipe = "qwen3_4b"
    for extra, expected in (((), False), (("trainer.val_before_train=true",), True)):
        code, out, err = _compose(_recipe_argv(recipe, "calibrate", tmp_path, *extra))
        assert code == 0, err[-3000:]
        assert OmegaConf.create(out).trainer.val_before_train is expected, extra


@pytest.mark.slow
def test_grpo_baseline_settings_identical_to_setgrpo(compositions):
    """Apart from the estimator, trainer mode, scorings per response and run names, the baseline composes to the
    same config."""

    def plain(cfg):
        d = OmegaConf.to_container(cfg, resolve=False)
        d["algorithm"] = {k: v for k, v in d["algorithm"].items() if k not in ("setgrpo", "_target_", "adv_estimator")}
        for k in ("experiment_name", "default_local_dir"):
            d["trainer"].pop(k)
        d["ray_kwargs"]["ray_init"]["runtime_env"].pop("env_vars")  # the loggers' files in the run's directory
        d["trainer"]["v1"].pop("trainer_mode")
        d["trainer"]["v1"].pop("setgrpo", None)
        d["reward"]["reward_kwargs"].pop("scorings", None)
        return d

    for recipe in RECIPES:
        assert plain(compositions[recipe, "grpo"][1]) == plain(compositions[recipe, "train"][1]), recipe


def test_misspelled_setgrpo_key_fails():
    code, _, err = _compose(["--config-path", CONFIG_DIR, "--config-name", "setgrpo_trainer", "algorithm.setgrpo.alpah=0.1"])
    assert code != 0 and "alpah" in err
    code, _, err = _compose(["--config-path", CONFIG_DIR, "--config-name", "setgrpo_trainer",
                             "algorithm.setgrpo.calibration.num_prompt=10"])
    assert code != 0 and "num_prompt" in err
    code, out, _ = _compose(["--config-path", CONFIG_DIR, "--config-name", "setgrpo_trainer", "algorithm.setgrpo.alpha=0.1"])
    assert code == 0 and OmegaConf.create(out).algorithm.setgrpo.alpha == 0.1


def test_dataclass_conversion_rejects_unknown_and_bad_values():
    code, out, _ = _compose(["--config-path", CONFIG_DIR, "--config-name", "setgrpo_trainer"])
    algorithm = OmegaConf.create(out).algorithm
    assert setgrpo_config_from(algorithm) == SetGRPOConfig()
    algorithm.setgrpo.betta = 0.1  # e.g. a typo written into a copied YAML file
    with pytest.raises(ValueError, match="betta"):
        setgrpo_config_from(algorithm)
    with pytest.raises(ValueError, match=r"algorithm\.setgrpo\.alpha=1\.5"):
        setgrpo_config_from({"setgrpo": {"alpha": 1.5}})
    with pytest.raises(ValueError, match="fixed_tau"):
        setgrpo_config_from({"setgrpo": {"ablation": "fixed_threshold"}})
    with pytest.raises(ValueError, match="setgrpo_trainer"):
        setgrpo_config_from(OmegaConf.create({"adv_estimator": "setgrpo"}))


def test_every_setgrpo_key_is_documented_and_matches_the_dataclass():
    lines = (Path(CONFIG_DIR) / "setgrpo_trainer.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line == "  setgrpo:")
    keys, prev = {}, lines[start - 1]
    for line in lines[start + 1 :]:
        if line.strip() and not line.startswith("    "):
            break  # end of the block
        m = re.match(r"^( +)([a-z_]+):", line)
        if m:
            assert prev.strip().startswith("#"), f"key {m.group(2)!r} has no comment line above it"
            keys.setdefault(len(m.group(1)), set()).add(m.group(2))
        if line.strip():
            prev = line
    fields = {f.name for f in dataclasses.fields(SetGRPOConfig)}
    assert keys[4] == fields  # _target_ is a BaseConfig field too
    for name in ("calibration", "sketch", "monitor"):
        sub = {f.name for f in dataclasses.fields(type(getattr(SetGRPOConfig(), name)))} - {"_target_"}
        assert sub <= keys[6], name


@pytest.mark.slow
def test_prepare_rubrichub_writes_disjoint_verl_splits(tmp_path):
    import json

    import pandas as pd

    from setgrpo_verl.grading.convert import load_ifbench_rubrics

    src = tmp_path / "rubrichub.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in load_ifbench_rubrics(limit=30)))
    env = {**os.environ, "RUBRICHUB_TRAIN": str(src), "DATA_DIR": str(tmp_path / "out"), "CALIB_SIZE": "10",
           "VAL_SIZE": "5", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "recipes" / "prepare_rubrichub.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = {n: pd.read_parquet(tmp_path / "out" / f"{n}.parquet") for n in ("train", "calib", "test")}
    assert {n: len(df) for n, df in parts.items()} == {"train": 15, "calib": 10, "test": 5}
    ids = [set(df.extra_info.map(lambda e: e["id"])) for df in parts.values()]
    assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    assert set(parts["train"].columns) >= {"prompt", "data_source", "reward_model", "extra_info"}
    env["CALIB_SIZE"] = "40"
    proc = subprocess.run(["bash", str(REPO / "recipes" / "prepare_rubrichub.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "lower CALIB_SIZE" in proc.stderr


@pytest.mark.parametrize(
    ("override", "message"),
    [("trainer.v1.trainer_mode=sync", "add the override `trainer.v1.trainer_mode=setgrpo`"),
     ("algorithm.adv_estimator=grpo", "set algorithm.adv_estimator=setgrpo"),
     ("algorithm.setgrpo.alpha=2", r"algorithm.setgrpo.alpha=2.0 must be a number in the open interval (0, 1)")],
)
def test_main_ppo_stops_before_ray_on_inconsistent_setgrpo_settings(override, message, tmp_path):
    """The Hydra callback of setgrpo_trainer.yaml runs before main_ppo's task (validate_config, Ray)."""
    old = sys.argv
    sys.argv = ["main_ppo", "--config-path", CONFIG_DIR, "--config-name", "setgrpo_trainer",
                f"hydra.run.dir={tmp_path / 'hydra'}", override]  # not outputs/ under the checkout
    try:
        with pytest.raises(SystemExit) as exc:
            main_ppo.main()
    finally:
        sys.argv = old
    assert isinstance(exc.value.code, str) and message in exc.value.code, exc.value.code


def test_yaml_block_is_generated_from_the_field_docs():
    from setgrpo_verl.integration.config import render_yaml

    text = (Path(CONFIG_DIR) / "setgrpo_trainer.yaml").read_text()
    assert render_yaml(indent=4) in text


def test_sketch_defaults_are_exactly_sketch_config():
    from setgrpo_verl.integration.config import SetGRPOSketchConfig
    from setgrpo_verl.integration.identity import run_identity
    from setgrpo_verl.sketch import SketchConfig

    assert SetGRPOSketchConfig().to_sketch_config() == SketchConfig()
    assert {f.name for f in dataclasses.fields(SketchConfig)} <= {f.name for f in dataclasses.fields(SetGRPOSketchConfig)}
    code, out, _ = _compose(["--config-path", CONFIG_DIR, "--config-name", "setgrpo_trainer",
                             "+reward.reward_kwargs.grader.type=rules",
                             f"actor_rollout_ref.model.path={embedded_model_dir()}"])
    cfg = OmegaConf.create(out)
    setgrpo = setgrpo_config_from(cfg.algorithm)
    assert setgrpo.sketch.to_sketch_config() == SketchConfig()  # what the worker receives
    assert run_identity(cfg, setgrpo)["sketch"] == dataclasses.asdict(SketchConfig())  # what the record stores
    code, out, _ = _compose(["--config-path", CONFIG_DIR, "--config-name", "setgrpo_trainer",
                             "algorithm.setgrpo.sketch.copies=8"])
    assert setgrpo_config_from(OmegaConf.create(out).algorithm).sketch.to_sketch_config().copies == 8


def test_no_default_judge_url(tmp_path):
    shim = tmp_path / "python"
    shim.write_text("#!/usr/bin/env bash\nexit 0\n")
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "JUDGE_BASE_URL"}
    proc = subprocess.run([*_command(RECIPES[0]), "train"], env={**env, "PYTHON": str(shim), "HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "set JUDGE_BASE_URL" in proc.stderr, proc.stderr


def test_loggers_run_anywhere_and_wandb_only_when_asked_or_keyed(tmp_path):
    """verl's wandb.init fails without a key, minutes in: the default is console + file + tensorboard, the files in
    the run's directory; wandb is added when a key is present, and LOGGER is taken as given."""
    def logger(argv):
        return next(a.split("=", 1)[1] for a in argv if a.startswith("trainer.logger="))

    recipe = "qwen3_4b"
    argv = _recipe_argv(recipe, "train", tmp_path)
    assert logger(argv) == '["console","file","tensorboard"]'
    run = tmp_path / "runs" / "qwen3-4b-setgrpo"
    assert f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={run}/metrics.jsonl" in argv
    assert f"+ray_kwargs.ray_init.runtime_env.env_vars.TENSORBOARD_DIR={run}/tensorboard" in argv
    assert run.is_dir()  # verl's file logger opens the file without creating its folder
    assert logger(_recipe_argv(recipe, "grpo", tmp_path, environ={"WANDB_API_KEY": "k"})).endswith(',"wandb"]')
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")  # `wandb login`
    assert logger(_recipe_argv(recipe, "train", tmp_path)).endswith(',"wandb"]')
    assert logger(_recipe_argv(recipe, "train", tmp_path, environ={"LOGGER": '["console"]'})) == '["console"]'


def test_several_nodes_refuse_a_loopback_judge_before_ray(tmp_path, monkeypatch):
    from setgrpo_verl.integration import support

    from setgrpo_verl.integration import run_check

    monkeypatch.setattr(support, "build_meta_policy", lambda model_cfg: None)  # hub models, offline
    monkeypatch.setattr(run_check, "run_identity", lambda config, setgrpo: {})  # (their files: the same)
    monkeypatch.setenv("SETGRPO_SHARED_FS", "1")  # both "nodes" are this machine (tests/integration/test_run_env.py)
    spec = importlib.machinery.ModuleSpec("flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn", SimpleNamespace(__spec__=spec))
    for url, refused in (("http://127.0.0.1:8000/v1", True), (JUDGE, False)):
        argv = _recipe_argv(RECIPES[0], "calibrate", tmp_path, environ={"NNODES": "2", "JUDGE_BASE_URL": url})
        code, out, err = _compose(argv)
        assert code == 0, err[-3000:]
        if refused:
            with pytest.raises(ValueError, match="is a loopback address, but trainer.nnodes=2"):
                check_run_config(OmegaConf.create(out))
        else:
            check_run_config(OmegaConf.create(out))


def test_the_judge_context_sets_the_response_cut(tmp_path, monkeypatch):
    monkeypatch.setenv("JUDGE_CONTEXT", "8192")
    for mode in MODES:  # the baseline's judge reads the same cut responses as SetGRPO's
        argv = _recipe_argv(RECIPES[0], mode, tmp_path)
        assert "+reward.reward_kwargs.grader.max_response_tokens=7168" in argv, mode


def test_every_recipe_runs_fsdp2_and_says_whether_the_policy_thinks(tmp_path):
    """FSDP2 is the strategy the CPU tests run; the policy's thinking is explicit (off unless asked for)."""
    for recipe in [*RECIPES, SMOKE]:
        mode = None if recipe == SMOKE else "train"  # the smoke recipe takes no mode
        argv = _recipe_argv(recipe, mode, tmp_path)
        assert "actor_rollout_ref.actor.strategy=fsdp2" in argv and "actor_rollout_ref.ref.strategy=fsdp2" in argv
        assert "+data.apply_chat_template_kwargs.enable_thinking=false" in argv, _name(recipe)
    argv = _recipe_argv(RECIPES[0], "train", tmp_path, environ={"POLICY_THINKING": "true"})
    assert "+data.apply_chat_template_kwargs.enable_thinking=true" in argv
    with pytest.raises(subprocess.CalledProcessError):
        _recipe_argv(RECIPES[0], "train", tmp_path, environ={"POLICY_THINKING": "yes"})


def test_the_one_gpu_smoke_recipe_composes_and_passes_the_check_before_ray(tmp_path, monkeypatch):
    from setgrpo_verl.integration import run_check
    from setgrpo_verl.integration import support

    monkeypatch.setattr(support, "build_meta_policy", lambda model_cfg: None)  # hub models, offline
    monkeypatch.setattr(run_check, "run_identity", lambda config, setgrpo: {})  # (their files: the same)
    spec = importlib.machinery.ModuleSpec("flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn", SimpleNamespace(__spec__=spec))
    argv = _recipe_argv(SMOKE, None, tmp_path, environ={"JUDGE_BASE_URL": "http://127.0.0.1:8001/v1"})
    code, out, err = _compose(argv)
    assert code == 0, err[-3000:]
    cfg = OmegaConf.create(out)
    check_run_config(cfg)  # a loopback judge is allowed on one node
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, cfg.actor_rollout_ref.rollout.n) == (1, 1, 4)
    assert cfg.actor_rollout_ref.rollout.name == "vllm" and cfg.actor_rollout_ref.actor.strategy == "fsdp2"
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen3-0.6B" and cfg.trainer.total_training_steps == 3
    assert cfg.reward.reward_kwargs.grader.max_concurrency == 32 and cfg.reward.num_workers == 1
    setgrpo = setgrpo_config_from(cfg.algorithm)
    # calibrate, then train in the same run, with the record it writes
    assert setgrpo.record_path is None and not setgrpo.calibration.only and setgrpo.calibration.num_prompts == 32
    assert setgrpo.record_out.endswith("qwen3-0.6b-smoke/setgrpo_calibration.json")
