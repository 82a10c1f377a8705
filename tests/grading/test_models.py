"""setgrpo_verl.models: the embedded SmolLM2-135M-Instruct loads offline and generates deterministically."""

import pytest
import torch

from setgrpo_verl.models import embedded_model_dir, load_causal_lm


@pytest.fixture(scope="module")
def smollm2():
    return load_causal_lm()


def test_embedded_model_generates_deterministically(smollm2):
    model, tokenizer = smollm2
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    # the GGUF tokenizer conversion mislabels EOS; the loader must follow the model config (<|im_end|>, id 2)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == model.config.eos_token_id == 2
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    prompt_len = enc["input_ids"].shape[1]
    with torch.no_grad():
        out1 = model.generate(**enc, max_new_tokens=8, do_sample=False)
        out2 = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert torch.equal(out1, out2)
    text = tokenizer.decode(out1[0, prompt_len:], skip_special_tokens=True)
    assert "Paris" in text, text


def test_local_directory_and_dtype(smollm2):
    model, _ = smollm2
    model16, tok16 = load_causal_lm(embedded_model_dir(), dtype=torch.bfloat16)
    assert model16.dtype == torch.bfloat16
    ref = model.model.embed_tokens.weight[:4, :8]
    assert torch.allclose(model16.model.embed_tokens.weight[:4, :8].float(), ref, rtol=1e-2, atol=1e-3)
    assert tok16.padding_side == "left" and tok16.pad_token_id == 2


def test_bad_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local Hugging Face model directory"):
        load_causal_lm(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="hub ids are not downloaded"):
        load_causal_lm("HuggingFaceTB/SmolLM2-135M-Instruct")
