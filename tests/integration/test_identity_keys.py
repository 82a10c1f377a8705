"""Every setting that changes a response or a gradient is part of the run identity, read where it takes effect in
the composed verl config (docs/record.md#run-identity): the table below enumerates the identity's keys, and for
each one a composed config that changes only that setting is refused, naming the key and its config source. A key
added to the identity without a row here fails :func:`test_the_table_enumerates_every_identity_key`."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
from hydra import compose, initialize_config_module

from setgrpo_verl.core import calibrate
from setgrpo_verl.core.identity import IdentityWarning, check_identity
from setgrpo_verl.integration.config import setgrpo_config_from
from setgrpo_verl.integration.run_check import check_record
from setgrpo_verl.integration.identity import IDENTITY_SOURCES, run_identity
from setgrpo_verl.models import embedded_model_dir

from ..core.synthetic import make_groups

BASE = ("+reward.reward_kwargs.grader={type:noisy,flip_prob:0.1,base:{type:rules}}", "actor_rollout_ref.rollout.n=4",
        "data.max_response_length=24")
JUDGE = "+reward.reward_kwargs.grader={type:openai,base_url:'http://127.0.0.1:9/v1',model:judge}"
JUDGE_CUT = "+reward.reward_kwargs.grader={type:openai,base_url:'http://127.0.0.1:9/v1',model:judge,max_response_tokens:64}"


def _compose(*overrides: str, base=BASE):
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("setgrpo_trainer", overrides=[*base, f"actor_rollout_ref.model.path={embedded_model_dir()}",
                                                     *overrides])


def _record(cfg):
    setgrpo = setgrpo_config_from(cfg.algorithm)
    settings = setgrpo.calibration_settings().replace(on_infeasible="reject_all")
    return calibrate(*make_groups(200, k=4, seed=0), settings, metadata=run_identity(cfg, setgrpo))


@pytest.fixture(scope="module")
def other_config(tmp_path_factory):
    """A config.json of the embedded model with one more layer's worth of context (another network)."""
    root = tmp_path_factory.mktemp("hf_config")
    config = json.loads((embedded_model_dir() / "config.json").read_text())
    config["max_position_embeddings"] = int(config.get("max_position_embeddings", 2048)) * 2
    (root / "config.json").write_text(json.dumps(config))
    return root


#: identity key -> (overrides that change only it, the config source its refusal names). The keys whose value is
#: the weights' or the tokenizer's files are covered by test_run_identity.py (named there, not changed here).
CHANGES = {
    "policy.temperature": (("actor_rollout_ref.rollout.temperature=0.7",), "actor_rollout_ref.rollout.temperature"),
    "policy.top_p": (("actor_rollout_ref.rollout.top_p=0.9",), "actor_rollout_ref.rollout.top_p"),
    "policy.top_k": (("actor_rollout_ref.rollout.top_k=20",), "actor_rollout_ref.rollout.top_k"),
    "policy.repetition_penalty": (("+actor_rollout_ref.rollout.repetition_penalty=1.1",),
                                  "actor_rollout_ref.rollout.repetition_penalty"),
    "policy.response_length": (("actor_rollout_ref.rollout.response_length=8",),
                               "actor_rollout_ref.rollout.response_length (where the rollout"),
    "policy.ignore_eos": (("actor_rollout_ref.rollout.ignore_eos=true",), "actor_rollout_ref.rollout.ignore_eos"),
    "policy.prompt_length": (("actor_rollout_ref.rollout.prompt_length=64",),
                             "actor_rollout_ref.rollout.prompt_length (where verl's agent loop left-truncates"),
    "policy.prompt_filter": (("data.filter_overlong_prompts=true",),
                             "data.max_prompt_length with data.filter_overlong_prompts"),
    "policy.dtype": (("actor_rollout_ref.rollout.dtype=float32",), "actor_rollout_ref.rollout.dtype"),
    "policy.chat_template_kwargs": (("+data.apply_chat_template_kwargs.enable_thinking=false",),
                                    "data.apply_chat_template_kwargs"),
    "policy.custom_chat_template_sha256": (
        ("actor_rollout_ref.model.custom_chat_template='{% for m in messages %}{{ m.content }}{% endfor %}'",),
        "actor_rollout_ref.model.custom_chat_template"),
    "policy.model_overrides": (("+actor_rollout_ref.model.override_config.model_config.num_hidden_layers=2",),
                               "actor_rollout_ref.model.override_config (its model_config block"),
    "policy.model_config_sha256": (("+actor_rollout_ref.model.hf_config_path={other}",),
                                   "actor_rollout_ref.model.hf_config_path"),
    "training.lora_rank": (("actor_rollout_ref.model.lora_rank=8",), "actor_rollout_ref.model.lora_rank"),
    "training.param_dtype": (
        ("+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",),
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"),
    "training.model_dtype": (("actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",),
                             "actor_rollout_ref.actor.fsdp_config.model_dtype"),
    "loss_agg_mode": (("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",), None),
    "sketch": (("algorithm.setgrpo.sketch.copies=32",), None),
    "grader": (("reward.reward_kwargs.grader.flip_prob=0.2",), None),
}
#: keys read by the test of LoRA records (test_run_identity.py::test_lora_target_modules_of_a_lora_record) or only
#: with LoRA on, and keys of the policy's files (test_run_identity.py): named so the enumeration is complete.
ELSEWHERE = {"policy.weights", "policy.weights_sha256", "policy.tokenizer_sha256", "training.lora_alpha",
             "training.target_modules", "training.target_parameters", "training.exclude_modules",
             "training.lora_adapter_sha256"}
#: never compared: the configured path, for people.
INFORMATIVE = {"policy.model"}


def _keys(identity: dict) -> set[str]:
    return {f"{name}.{k}" if name in ("policy", "training") else name
            for name, value in identity.items() for k in (value if name in ("policy", "training") else [None])}


def test_the_table_enumerates_every_identity_key():
    cfg = _compose()
    keys = _keys(run_identity(cfg, setgrpo_config_from(cfg.algorithm)))
    assert keys == set(CHANGES) | ELSEWHERE | INFORMATIVE
    # each policy / training key names its config source in a refusal
    assert {k for k in keys if k.startswith(("policy.", "training."))} - INFORMATIVE <= set(IDENTITY_SOURCES)


@pytest.fixture(scope="module")
def plain():
    cfg = _compose()
    return cfg, _record(cfg)


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_a_run_that_changes_one_setting_is_refused_naming_where_it_is_read(plain, other_config, key):
    cfg, record = plain
    overrides, source = CHANGES[key]
    changed = _compose(*(o.replace("{other}", str(other_config)) for o in overrides))
    with pytest.raises(ValueError) as info:
        check_record(record, changed, setgrpo_config_from(changed.algorithm))
    text = str(info.value)
    assert text.startswith(f"calibration record mismatch in {key}"), text
    if source is not None:
        assert f"({source}" in text, text


def test_the_response_length_is_read_where_the_rollout_cuts():
    """data.max_response_length and rollout.response_length differ: the rollout's value is the one recorded."""
    cfg = _compose("actor_rollout_ref.rollout.response_length=8")
    assert cfg.data.max_response_length == 24
    assert run_identity(cfg, setgrpo_config_from(cfg.algorithm))["policy"]["response_length"] == 8


def test_overrides_that_do_not_change_the_network_are_accepted(plain):
    """The attention kernel, at either level of override_config, computes the same function."""
    cfg, record = plain
    for override in ("+actor_rollout_ref.model.override_config.attn_implementation=eager",
                     "+actor_rollout_ref.model.override_config.model_config.attn_implementation=sdpa"):
        changed = _compose(override)
        with warnings.catch_warnings():
            warnings.simplefilter("error", IdentityWarning)
            check_record(record, changed, setgrpo_config_from(changed.algorithm))


def test_the_judges_response_cut_is_part_of_the_grader_identity():
    """--judge-max-response-tokens (grader.max_response_tokens) changes what the judge is asked."""
    cut, whole = (_compose(base=(g, *BASE[1:])) for g in (JUDGE_CUT, JUDGE))
    a, b = (run_identity(c, setgrpo_config_from(c.algorithm)) for c in (cut, whole))
    with pytest.raises(ValueError, match=r"mismatch in grader.template_hash"):
        check_identity(a, b, what="calibration record", holder="record")


def test_records_without_the_new_keys_warn_and_compare_in_either_order(plain):
    """A record or shard written before prompt_length, prompt_filter and model_config_sha256 existed is not checked
    on them (named in a warning) whichever side is older; one without ignore_eos was made with verl's default."""
    _, record = plain
    new = {"policy": dict(record.policy)}
    old = {"policy": {k: v for k, v in record.policy.items()
                      if k not in ("prompt_length", "prompt_filter", "model_config_sha256", "ignore_eos")}}
    for stored, current in ((old, new), (new, old)):
        with pytest.warns(IdentityWarning, match="policy.prompt_length, policy.prompt_filter, "
                                                 "policy.model_config_sha256"):
            check_identity(stored, current, what="calibration shard", holder="shard")
    eos = {"policy": {**record.policy, "ignore_eos": True}}
    with pytest.raises(ValueError, match=r"shard has no policy.ignore_eos \(written before that field existed, so "
                                         r"read as False\), this run has True"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", IdentityWarning)
            check_identity(old, eos, what="calibration shard", holder="shard")
