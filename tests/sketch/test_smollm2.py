"""On the embedded SmolLM2-135M-Instruct the default sketch reproduces the exact 4 x 4 response cosine matrix
within 0.05 (max abs entry), docs/sketch.md#measured-accuracy."""

from __future__ import annotations

import pytest
import torch

from setgrpo_verl.sketch import SketchConfig, compute_sketches
from tests.sketch._tiny import cosine

RESPONSES = [
    "Crimson leaves drift down,\nwhispering to the cold ground,\nautumn says goodbye.",
    "Golden maple falls\nSoft wind carries it away\nThe trees stand bare now",
    "Leaves fall.",
    "Autumn is a season in which the leaves of deciduous trees change colour and fall.",
]


@pytest.mark.slow
def test_default_sketch_cosines_within_005_on_smollm2():
    models = pytest.importorskip("setgrpo_verl.models")
    model, tok = models.load_causal_lm()
    model.eval()
    # Untie the LM head from the embedding (same values, same forward) so that per-parameter autograd
    # gradients are the per-block gradients the default sketch (nn.Linear blocks only) estimates.
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about autumn leaves."}], add_generation_prompt=True, tokenize=True
    )
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    responses = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in RESPONSES]
    t_resp = max(len(r) for r in responses)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([prompt + r + [pad] * (t_resp - len(r)) for r in responses])
    am = torch.tensor([[1] * len(prompt) + [1] * len(r) + [0] * (t_resp - len(r)) for r in responses])
    rm = am[:, len(prompt) :].clone()

    out = compute_sketches(model, ids, am, rm, SketchConfig())
    assert out.sketches.shape == (4, 30 * 7 * 128 + 2048)
    assert all(p.grad is None for p in model.parameters())

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    grads = []
    for b in range(4):
        model.zero_grad(set_to_none=True)
        n = int(am[b].sum())
        logits = model(input_ids=ids[b : b + 1, :n], use_cache=False).logits[0, len(prompt) - 1 : n - 1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[b, len(prompt) : n, None]).squeeze(-1)
        lp.sum().backward()
        grads.append(torch.cat([m.weight.grad.flatten() for m in linears]))
    model.zero_grad(set_to_none=True)
    g = torch.stack(grads).double()
    del grads
    exact = cosine(g @ g.T)
    del g
    # same responses' log-probs from the sketch pass
    sketch_cos = cosine(out.sketches.double() @ out.sketches.double().T)
    err = (sketch_cos - exact).abs().max().item()
    print(f"exact cosines\n{exact}\nsketch cosines\n{sketch_cos}\nmax abs error {err:.4f}")
    assert err <= 0.05
