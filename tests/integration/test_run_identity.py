"""A record and its shards know what they calibrated (docs/record.md#run-identity): a run that differs in LoRA, the
chat template and its arguments, the tokenizer, top_k or repetition_penalty, the compute precision or the weights
is refused before Ray naming the field and its config key; the same weights under another path are accepted;
records and shards written before these fields existed load, with a warning naming them."""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from safetensors.torch import save_file

from setgrpo_verl.core import calibrate, CalibrationRecord, CalibrationSettings
from setgrpo_verl.core.identity import IdentityWarning
from setgrpo_verl.core.shards import CalibrationShard, load_shards, read_shard, shard_identity, write_shard
from setgrpo_verl.integration.config import setgrpo_config_from
from setgrpo_verl.integration.run_check import SetGRPOConfigCheck, check_record, check_run_config
from setgrpo_verl.integration.identity import run_identity, weights_fingerprint
from setgrpo_verl.models import embedded_model_dir
from setgrpo_verl.runner.launch import cpu_overrides

from ..core.synthetic import make_groups

REPO = Path(__file__).resolve().parents[2]
SCHEMA_5 = REPO / "tests" / "core" / "data" / "record_schema5.json"
PAPER_SHARD = REPO / "validation" / "paper" / "batch_000000.npz"
BASE = ("+reward.reward_kwargs.grader={type:noisy,flip_prob:0.1,base:{type:rules}}", "actor_rollout_ref.rollout.n=4",
        "data.max_response_length=24")


def _compose(*overrides: str, model: str | None = None):
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("setgrpo_trainer", overrides=[*BASE, f"actor_rollout_ref.model.path={model or embedded_model_dir()}",
                                                     *overrides])


def _record(cfg) -> CalibrationRecord:
    """A record calibrated (synthetic groups) for the run ``cfg`` describes, with that run's identity."""
    setgrpo = setgrpo_config_from(cfg.algorithm)
    settings = setgrpo.calibration_settings().replace(on_infeasible="reject_all")
    return calibrate(*make_groups(200, k=4, seed=0), settings, metadata=run_identity(cfg, setgrpo))


def _refusal(record, cfg) -> str:
    with pytest.raises(ValueError) as info:
        check_record(record, cfg, setgrpo_config_from(cfg.algorithm))
    return str(info.value)


def _accepts(record, cfg) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", IdentityWarning)
        check_record(record, cfg, setgrpo_config_from(cfg.algorithm))


@pytest.fixture(scope="module")
def plain():
    cfg = _compose()
    return cfg, _record(cfg)


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """The embedded tokenizer's files with one setting changed (another tokenizer), and an unchanged copy."""
    root = tmp_path_factory.mktemp("tokenizers")
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    for which in ("same", "other"):
        (root / which).mkdir()
        for name in names:
            shutil.copy(embedded_model_dir() / name, root / which / name)
    config = json.loads((root / "other" / "tokenizer_config.json").read_text())
    config["model_max_length"] = 77
    (root / "other" / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize(("overrides", "field", "values"), [
    (("actor_rollout_ref.model.lora_rank=8",), "training.lora_rank (actor_rollout_ref.model.lora_rank)",
     "record has 0, this run has 8"),
    (("actor_rollout_ref.model.lora_rank=64", "actor_rollout_ref.model.lora_alpha=128"), "training.lora_rank",
     "record has 0, this run has 64"),
    (("+data.apply_chat_template_kwargs.enable_thinking=false",),
     "policy.chat_template_kwargs (data.apply_chat_template_kwargs)", "record has {}, this run has "
                                                                      "{'enable_thinking': False}"),
    (("actor_rollout_ref.model.custom_chat_template='{% for m in messages %}{{ m.content }}{% endfor %}'",),
     "policy.custom_chat_template_sha256 (actor_rollout_ref.model.custom_chat_template)", "record has None"),
    (("actor_rollout_ref.rollout.top_k=20",), "policy.top_k (actor_rollout_ref.rollout.top_k)",
     "record has -1, this run has 20"),
    (("+actor_rollout_ref.rollout.repetition_penalty=1.1",),
     "policy.repetition_penalty (actor_rollout_ref.rollout.repetition_penalty)", "record has 1.0, this run has 1.1"),
    (("actor_rollout_ref.rollout.dtype=float32",), "policy.dtype (actor_rollout_ref.rollout.dtype)",
     "record has 'bfloat16', this run has 'float32'"),
    (("+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",),
     "training.param_dtype (actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype)",
     "record has 'bfloat16', this run has 'float32'"),
    (("actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",), "training.model_dtype",
     "record has 'float32', this run has 'bfloat16'"),
])
def test_a_run_that_differs_in_a_field_is_refused_naming_it(plain, overrides, field, values):
    cfg, record = plain
    _accepts(record, cfg)
    text = _refusal(record, _compose(*overrides))
    assert text.startswith(f"calibration record mismatch in {field}"), text
    assert values in text and "recalibrate" in text


def test_lora_target_modules_of_a_lora_record(plain):
    lora = _compose("actor_rollout_ref.model.lora_rank=8")
    record = _record(lora)
    assert record.training["target_modules"] == "all-linear" and record.training["lora_alpha"] == 16.0
    _accepts(record, lora)
    text = _refusal(record, _compose("actor_rollout_ref.model.lora_rank=8",
                                     "actor_rollout_ref.model.target_modules=[v_proj,q_proj]"))
    assert text.startswith("calibration record mismatch in training.target_modules "
                           "(actor_rollout_ref.model.target_modules): record has 'all-linear', this run has "
                           "['q_proj', 'v_proj']")
    # without LoRA its settings are not part of the run: changing them changes nothing
    _accepts(plain[1], _compose("actor_rollout_ref.model.target_modules=[q_proj]"))


def test_the_tokenizer_is_identified_by_its_files(plain, other_tokenizer):
    _, record = plain
    _accepts(record, _compose(f"actor_rollout_ref.model.tokenizer_path={other_tokenizer / 'same'}"))
    text = _refusal(record, _compose(f"actor_rollout_ref.model.tokenizer_path={other_tokenizer / 'other'}"))
    assert text.startswith("calibration record mismatch in policy.tokenizer_sha256 "
                           "(actor_rollout_ref.model.tokenizer_path")


def test_the_cpu_backends_precision_is_part_of_the_identity(plain):
    """The CPU default depends on the machine (bf16 units or not): two machines' runs, or parts, differ in it."""
    bf16, fp32 = (run_identity(c, setgrpo_config_from(c.algorithm)) for c in (
        _compose(*cpu_overrides(precision="bf16")), _compose(*cpu_overrides(precision="fp32"))))
    assert (bf16["training"]["param_dtype"], fp32["training"]["param_dtype"]) == ("bfloat16", "float32")
    assert (bf16["policy"]["dtype"], fp32["policy"]["dtype"]) == ("bfloat16", "float32")
    record = _record(_compose(*cpu_overrides(precision="bf16")))
    assert "mismatch in policy.dtype" in _refusal(record, _compose(*cpu_overrides(precision="fp32")))


def _tiny_model(directory: Path, scale: float) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    save_file({"embed.weight": torch.randn(16, 8, generator=gen) * scale,
               "head.weight": torch.randn(4, 8, generator=gen, dtype=torch.float32).to(torch.bfloat16)},
              str(directory / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_dir() / name, directory / name)
    return directory


def test_weights_are_identified_by_content_not_path(tmp_path):
    model = _tiny_model(tmp_path / "a", 1.0)
    record = _record(_compose(model=str(model)))
    assert record.policy["weights"] == "safetensors: 1 file(s), 2 tensors, 160 parameters (BF16, F32)"
    assert record.policy["model"] == str(model)
    # the same files under another path: the same policy
    shutil.copytree(model, tmp_path / "copy")
    _accepts(record, _compose(model=str(tmp_path / "copy")))
    # other weights of the same shapes saved at the same path: refused, although every header is the same
    _tiny_model(model, 2.0)
    text = _refusal(record, _compose(model=str(model)))
    assert text.startswith("calibration record mismatch in policy.weights_sha256 (actor_rollout_ref.model.path (the "
                           "weight files)): record has '" + record.policy["weights_sha256"])


def test_the_weights_fingerprint_is_cheap_and_sees_every_tensor(tmp_path):
    model = _tiny_model(tmp_path / "m", 1.0)
    first = weights_fingerprint(model)
    assert weights_fingerprint(model) == first and len(first["weights_sha256"]) == 64
    tensors = {"embed.weight": torch.zeros(16, 8), "head.weight": torch.zeros(4, 8)}
    save_file(tensors, str(model / "model.safetensors"))
    zeros = weights_fingerprint(model)["weights_sha256"]
    tensors["head.weight"][2, 3] = 1.0  # one value of the smaller tensor, in its sampled bytes
    save_file(tensors, str(model / "model.safetensors"))
    assert weights_fingerprint(model)["weights_sha256"] != zeros
    (model / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="holds no weight files"):
        weights_fingerprint(model)
    (model / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="is not a safetensors file"):
        weights_fingerprint(model)


def test_a_model_that_cannot_be_read_is_refused_before_ray(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = _compose(model=str(_tiny_model(tmp_path / "m", 1.0)))
    setgrpo = setgrpo_config_from(cfg.algorithm)
    cfg.actor_rollout_ref.model.path = "acme/not-cached-anywhere"
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.path=acme/not-cached-anywhere: not a local "
                                         r"directory, and not a Hugging Face model this machine has cached or could "
                                         r"download .*`hf download acme/not-cached-anywhere`"):
        run_identity(cfg, setgrpo)
    cfg.actor_rollout_ref.model.path = "hdfs://models/policy"
    with pytest.raises(ValueError, match="a remote path cannot be read before Ray"):
        run_identity(cfg, setgrpo)


class _FakeHub:
    """huggingface_hub's snapshot_download over one hub model (``files``) and one cache folder: a repo id resolves
    from the cache once downloaded; with ``online=False`` nothing can be downloaded (another node, no network)."""

    def __init__(self, cache: Path, files: dict[str, Path], online: bool = True):
        self.cache, self.files, self.online, self.downloads = cache, files, online, []

    def __call__(self, repo_id, *, local_files_only=False, allow_patterns=None, **kwargs):
        from huggingface_hub.errors import LocalEntryNotFoundError

        snapshot = self.cache / repo_id.replace("/", "--")
        if snapshot.is_dir():
            return str(snapshot)
        if local_files_only or not self.online or repo_id not in self.files:
            raise LocalEntryNotFoundError(f"{repo_id} is not in the cache {self.cache}")
        self.downloads.append((repo_id, tuple(allow_patterns or ())))
        shutil.copytree(self.files[repo_id], snapshot)
        return str(snapshot)


def test_a_model_id_not_yet_in_the_cache_is_downloaded_as_verl_would(tmp_path, monkeypatch):
    """verl hands a hub id to from_pretrained, which downloads it: the identity does the same, into the same cache,
    and identifies the downloaded files by content (the same as the local directory's)."""
    import huggingface_hub

    model = _tiny_model(tmp_path / "upstream", 1.0)
    hub = _FakeHub(tmp_path / "cache", {"acme/tiny": model})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    cfg = _compose(model="acme/tiny")
    setgrpo = setgrpo_config_from(cfg.algorithm)
    downloaded = run_identity(cfg, setgrpo)
    assert [repo for repo, _ in hub.downloads] == ["acme/tiny"] and "*.safetensors" in hub.downloads[0][1]
    local = run_identity(_compose(model=str(model)), setgrpo)
    assert downloaded["policy"] == {**local["policy"], "model": "acme/tiny"}
    assert run_identity(cfg, setgrpo) == downloaded and len(hub.downloads) == 1  # cached now


def test_the_taskrunner_uses_the_identity_the_driver_accepted(tmp_path, monkeypatch):
    """verl's TaskRunner, on another node or with another HF_HOME, does not read its own cache: the driver's
    fingerprints reach it through the job's runtime environment, so it accepts what the driver accepted."""
    import sys
    import types

    import huggingface_hub

    from setgrpo_verl.integration import identity
    from setgrpo_verl.integration.judge_access import runtime_env_with_judge_key

    model = _tiny_model(tmp_path / "upstream", 1.0)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _FakeHub(tmp_path / "driver", {"acme/tiny": model}))
    monkeypatch.setattr(identity, "_COMPUTED", {})
    cfg = _compose(model="acme/tiny")
    setgrpo = setgrpo_config_from(cfg.algorithm)
    on_driver = run_identity(cfg, setgrpo)
    driver_env: dict = {}
    assert identity.carry_policy_files(driver_env)
    for name in ("RAY_RUNTIME_ENV_HOOK", "SETGRPO_RAY_FORWARD", identity.POLICY_FILES_ENV):
        monkeypatch.setenv(name, driver_env[name])
    job_env = runtime_env_with_judge_key({})["env_vars"]  # what ray.init gives every worker of the job
    # the TaskRunner: a Ray actor on a node whose cache is empty and which cannot download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _FakeHub(tmp_path / "node2", {}, online=False))
    monkeypatch.setenv(identity.POLICY_FILES_ENV, job_env[identity.POLICY_FILES_ENV])
    actor = types.SimpleNamespace(get_actor_id=lambda: "task-runner")
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True,
                                                                  get_runtime_context=lambda: actor))
    assert run_identity(cfg, setgrpo) == on_driver
    # the driver itself never takes a carried value: it reads the files
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: False))
    with pytest.raises(ValueError, match="acme/tiny: not a local directory"):
        run_identity(cfg, setgrpo)


def test_the_hydra_callback_refuses_before_ray(plain, tmp_path):
    _, record = plain
    record.to_json(tmp_path / "record.json")
    cfg = _compose(f"algorithm.setgrpo.record_path={tmp_path / 'record.json'}", "algorithm.setgrpo.calibration.only=true",
                   "actor_rollout_ref.rollout.top_k=20", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                   "+actor_rollout_ref.model.override_config.attn_implementation=eager")
    with pytest.raises(SystemExit, match=r"setgrpo_verl config error: calibration record mismatch in policy.top_k "):
        SetGRPOConfigCheck().on_job_start(config=cfg)
    cfg.actor_rollout_ref.rollout.top_k = -1
    assert check_run_config(cfg) is not None


def test_a_schema_5_record_loads_and_names_the_fields_it_lacks(plain):
    stored = json.loads(SCHEMA_5.read_text())
    assert stored["schema_version"] == 5 and "training" not in stored
    old = CalibrationRecord.from_json(SCHEMA_5)
    assert old.schema_version == 6 and old.training == {} and old.policy["model"] == "/models/policy"
    cfg = _compose("reward.reward_manager.name=naive", "data.max_response_length=24",
                   "algorithm.setgrpo.alpha=0.2", "algorithm.setgrpo.beta=0.5", "algorithm.setgrpo.delta=0.2")
    with pytest.warns(IdentityWarning) as caught:
        check_record(old, cfg, setgrpo_config_from(cfg.algorithm))
    (text,) = [str(w.message) for w in caught if w.category is IdentityWarning]
    assert text.startswith("calibration record has no policy.weights, policy.weights_sha256, policy.tokenizer_sha256, "
                           "policy.custom_chat_template_sha256, policy.chat_template_kwargs, policy.top_k, "
                           "policy.repetition_penalty, policy.dtype, training.lora_rank, training.lora_alpha, "
                           "training.target_modules, training.target_parameters, training.exclude_modules, "
                           "training.lora_adapter_sha256, training.param_dtype, training.model_dtype: it was written "
                           "before these identity fields existed, so they are not checked against this run")
    # the fields it has are still checked (the path, /models/policy, never is)
    changed = _compose("reward.reward_manager.name=naive", "data.max_response_length=48",
                       "algorithm.setgrpo.alpha=0.2", "algorithm.setgrpo.beta=0.5", "algorithm.setgrpo.delta=0.2")
    with pytest.raises(ValueError, match="mismatch in policy.response_length .*: record has 24, this run has 48"):
        check_record(old, changed, setgrpo_config_from(changed.algorithm))


def test_shards_carry_the_identity_and_older_shards_load_with_a_warning(plain, tmp_path):
    cfg, _ = plain
    run = run_identity(cfg, setgrpo_config_from(cfg.algorithm))
    paper = read_shard(PAPER_SHARD)
    assert "training" not in paper.identity and "weights_sha256" not in paper.identity["policy"]
    (tmp_path / "old").mkdir()
    shutil.copy(PAPER_SHARD, tmp_path / "old" / PAPER_SHARD.name)
    # this run's identity with the paper run's values in the fields the shard has (its path differs: not compared)
    current = {**paper.identity, "policy": {**run["policy"], **{k: v for k, v in paper.identity["policy"].items()
                                                                 if k != "model"}},
               "training": run["training"]}
    with pytest.warns(IdentityWarning, match=r"calibration shard .*batch_000000.npz has no policy.chat_template_kwargs, "
                                             r".*policy.weights_sha256, training: it was written before"):
        shards, _ = load_shards(tmp_path / "old", current)
    assert list(shards) == [0]
    # a shard written now carries the whole identity, and a run that differs in one field is refused naming it
    settings = CalibrationSettings(alpha=0.2, beta=0.4, delta=0.2, on_infeasible="reject_all")
    ident = shard_identity(k=4, settings=settings, split_seed=0, run=run, prompts=list(paper.prompts),
                           batch_size=len(paper.prompts))
    write_shard(tmp_path / "new", CalibrationShard(
        index=0, prompts=paper.prompts, point=paper.point, reference=paper.reference, gram=paper.gram, truth=None,
        prompt_index=paper.prompt_index, identity=ident))
    fp32 = {**ident, "training": {**ident["training"], "param_dtype": "float32"}}
    with pytest.raises(ValueError, match=r"calibration shard .*batch_000000.npz mismatch in training.param_dtype: "
                                         r"shard has 'bfloat16', this run has 'float32'"):
        load_shards(tmp_path / "new", fp32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", IdentityWarning)
        assert list(load_shards(tmp_path / "new", ident)[0]) == [0]


def test_training_with_a_record_and_no_monitor_may_score_once(plain, tmp_path):
    """The paper variant reads the reference score only in calibration and in the online monitor: training with a
    frozen record and the monitor off needs one grader call per response, as GRPO."""
    _, record = plain
    record.to_json(tmp_path / "record.json")
    once = ("+reward.reward_kwargs.scorings=1", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "+actor_rollout_ref.model.override_config.attn_implementation=eager",
            f"algorithm.setgrpo.record_path={tmp_path / 'record.json'}", "algorithm.setgrpo.calibration.only=true")
    with pytest.raises(ValueError, match=r"scorings=1: SetGRPO needs the reference score r' of a second scoring here "
                                         r"\(the online monitor reads it during training\)"):
        check_run_config(_compose(*once))
    assert check_run_config(_compose(*once, "algorithm.setgrpo.monitor.enable=false")).monitor.enable is False


def test_model_config_overrides_are_part_of_the_identity_but_the_attention_kernel_is_not(plain):
    """verl applies actor_rollout_ref.model.override_config to the model's config: the same files with two layers
    are another network, refused naming the key; eager against sdpa attention is the same function. A record
    written before the key existed was made without overrides."""
    _, record = plain
    assert record.policy["model_overrides"] == {}
    _accepts(record, _compose("+actor_rollout_ref.model.override_config.attn_implementation=sdpa"))
    text = _refusal(record, _compose("+actor_rollout_ref.model.override_config.num_hidden_layers=2"))
    assert text.startswith("calibration record mismatch in policy.model_overrides "
                           "(actor_rollout_ref.model.override_config): record has {}, this run has "
                           "{'num_hidden_layers': 2}")
    older = dataclasses.replace(record, policy={k: v for k, v in record.policy.items() if k != "model_overrides"})
    _accepts(older, _compose())
    assert "mismatch in policy.model_overrides" in _refusal(
        older, _compose("+actor_rollout_ref.model.override_config.num_hidden_layers=2"))


def test_identities_with_and_without_model_overrides_compare_in_either_order(plain):
    """Shards of one calibration written before and after the key existed merge whichever comes first; a run with
    overrides against a stored identity without the key is refused, saying how the key was read."""
    from setgrpo_verl.core.identity import check_identity

    _, record = plain
    new = {"policy": dict(record.policy)}
    old = {"policy": {k: v for k, v in record.policy.items() if k != "model_overrides"}}
    for stored, current in ((old, new), (new, old)):
        check_identity(stored, current, what="calibration shard", holder="shard")
    layers = {"policy": {**record.policy, "model_overrides": {"num_hidden_layers": 2}}}
    with pytest.raises(ValueError, match=r"shard has no policy.model_overrides \(written before that field existed, "
                                         r"so read as \{\}\), this run has \{'num_hidden_layers': 2\}"):
        check_identity(old, layers, what="calibration shard", holder="shard")
