"""End to end: a GPT with the Triton kernels on (interpreted) trains 5 steps with the torch path's losses."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron.core.parallel_state import GroupInfo
from megatron.kernels import select
from megatron.model.gpt_model import GPTModel
from megatron.config.sizes import named_model

STEPS = 5


def _train(name: str, backend: str, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
           **overrides) -> list[float]:
    """Losses of STEPS AdamW steps on one fixed batch; overrides replace ModelConfig fields (tests/gpu uses
    device/dtype/overrides to give the HIP kernels head dim 64 in bf16 on a GPU)."""
    # fp32, no dropout: the two runs differ only in the kernels, so losses agree to fp32 rounding.
    # seq 24 = one full and one ragged 16-row tile; batch 1 keeps the interpreter's program count low.
    fields = dict(seq_length=24, hidden_dropout=0.0, attention_dropout=0.0, attention_backend=backend)
    cfg = named_model(name, **{**fields, **overrides})
    torch.manual_seed(0)
    model = GPTModel(cfg, tp=GroupInfo([0], 0, None), init_seed=1234).to(device=device, dtype=dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length + 1), generator=g).to(device)
    losses = []
    for _ in range(STEPS):  # one fixed batch: the loss must fall, which shows the gradients are used
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["debug", "debug-llama"])  # LayerNorm + MHA; RMSNorm + GQA + RoPE
def test_triton_and_torch_losses_agree(name, monkeypatch, caplog):
    select._said.clear()
    with caplog.at_level(logging.INFO, logger="megatron.kernels.select"):
        # Norms follow the model's kernel backend too (ModelConfig.attention_backend).
        triton_losses = _train(name, "triton")
    assert select.choose("norm", "triton", torch.device("cpu")) == "triton"
    assert select.choose("attention", "triton", torch.device("cpu")) == "triton"
    assert not any("falling back" in r.message or "unavailable" in r.message for r in caplog.records)

    monkeypatch.delenv("TRITON_INTERPRET")  # without it, 'auto' norms on CPU are torch's
    select._said.clear()
    torch_losses = _train(name, "torch")

    assert triton_losses[-1] < triton_losses[0]  # it trains
    for got, ref in zip(triton_losses, torch_losses, strict=True):
        assert abs(got - ref) <= 1e-4, (triton_losses, torch_losses)
