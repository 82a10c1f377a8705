"""A policy whose reasoning markers are special tokens (gpt-oss's harmony channels, Magistral's [THINK]) is graded
on its answer, as a <think> policy is, and a response cut inside its reasoning has no answer
(docs/grading.md#thinking-policies). The embedded tokenizer with those markers added as special tokens, as in the
real models' tokenizers, and the setgrpo_dual reward manager run as verl's reward worker runs it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from verl import DataProto

from setgrpo_verl.grading.answers import visible_response
from setgrpo_verl.integration.reward_manager import SetGRPODualRewardManager
from setgrpo_verl.models import embedded_model_dir

ROW = {"id": "row-1", "question": "What is the capital of Australia?",
       "rubrics": [{"criterion": "The response has no commas.", "points": 1,
                    "rule": {"id": "ifeval:punctuation:no_comma", "kwargs": {}}}]}
HARMONY = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>")
REASONING = "Maybe Sydney, or Canberra, let me think"  # commas: the rule fails on the reasoning
CASES = {
    "think": ((), f"<think>{REASONING}</think>\n\nCanberra is the capital.", f"<think>{REASONING} about"),
    "harmony": (HARMONY, f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>final"
                         "<|message|>Canberra is the capital.<|return|>", f"<|channel|>analysis<|message|>{REASONING}"),
    "magistral": (("[THINK]", "[/THINK]"), f"[THINK]{REASONING}[/THINK]Canberra is the capital.",
                  f"[THINK]{REASONING} about"),
}


def _score(special, text) -> dict:
    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir()), local_files_only=True)
    if special:
        tok.add_special_tokens({"additional_special_tokens": list(special)})
    prompt = tok.encode("<|im_start|>user\nWhat is the capital of Australia?<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)
    response = tok.encode(text, add_special_tokens=False)
    data = DataProto.from_dict(
        tensors={"prompts": torch.tensor([prompt]), "responses": torch.tensor([response]),
                 "attention_mask": torch.ones(1, len(prompt) + len(response), dtype=torch.long),
                 "response_mask": torch.ones(1, len(response), dtype=torch.long)},
        non_tensors={"reward_model": np.array([{"ground_truth": json.dumps(ROW)}], dtype=object),
                     "extra_info": np.array([{"id": "row-1", "index": 0}], dtype=object),
                     "data_source": np.array(["rubrichub"], dtype=object)})
    config = OmegaConf.create({"reward": {"reward_manager": {"name": "setgrpo_dual", "source": "register"},
                                          "reward_kwargs": {"grader": {"type": "rules"}, "scorings": 1}}})
    SetGRPODualRewardManager._scorers.clear()
    manager = SetGRPODualRewardManager(config, tok)
    return manager.loop.run_until_complete(manager.run_single(data))


@pytest.mark.parametrize("policy", sorted(CASES))
def test_the_answer_is_graded_and_a_cut_reasoning_has_no_answer(policy):
    special, closed, cut = CASES[policy]
    out = _score(special, closed)
    assert (out["reward_score"], out["reward_extra_info"]["no_answer"]) == (1.0, 0), out
    assert out["reward_extra_info"]["noise_scale"] == 1.0  # one 1-point criterion
    out = _score(special, cut)
    assert (out["reward_score"], out["reward_extra_info"]["no_answer"]) == (0.0, 1), out


def test_visible_response_spells_the_reasoning_block_and_drops_other_special_tokens():
    assert visible_response("[THINK]a[/THINK]b</s>", ["</s>", "[THINK]", "[/THINK]"]) == "<think>a</think>b"
    assert visible_response("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b"
                            "<|return|>", HARMONY) == "<think>analysisaassistant</think>b"
    assert visible_response("<|channel|>final<|message|>b", HARMONY) == "<think></think>b"
    assert visible_response("<|im_start|>plain<|im_end|>", ["<|im_start|>", "<|im_end|>"]) == "plain"
