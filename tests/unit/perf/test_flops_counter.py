"""Megatron's FLOPs formula (megatron/perf/flops.py) against torch's FlopCounterMode on our GPTModel.

Attention runs through SDPA's math backend here: torch's flop counter has no formula for the fused CPU SDPA
kernel, while the math backend's batched matmuls are counted like any other.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from megatron.core.parallel_state import GroupInfo
from megatron.model.gpt_model import GPTModel
from megatron.config.sizes import named_model
from megatron.perf.flops import iteration_flops


def counted_flops(cfg, batch: int, early_stop: bool = True) -> float:
    torch.manual_seed(0)
    model = GPTModel(cfg, tp=GroupInfo([0], 0, None))
    model.train()
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length))
    with (sdpa_kernel(SDPBackend.MATH), set_checkpoint_early_stop(early_stop),
          FlopCounterMode(display=False) as counter):
        model(tokens, tokens).mean().backward()
    return float(counter.get_total_flops())


@pytest.mark.parametrize("name", ["debug", "tiny", "debug-llama"])
def test_forward_backward_within_2_percent(name):
    cfg = named_model(name, hidden_dropout=0.0, attention_dropout=0.0)
    want = iteration_flops(cfg, 2).model
    assert counted_flops(cfg, 2) == pytest.approx(want, rel=0.02)


def test_full_recompute_counts_one_more_forward_of_the_layers():
    cfg = named_model("debug", hidden_dropout=0.0, attention_dropout=0.0, recompute_granularity="full")
    flops = iteration_flops(cfg, 2, recompute_granularity="full")
    assert flops.recompute > 0
    assert counted_flops(cfg, 2, early_stop=False) == pytest.approx(flops.total, rel=0.02)
    # torch's default non-reentrant checkpoint stops recomputing once the saved tensors the backward needs are
    # back, so a layer's last matmul (FC2, whose output nothing saves) is skipped: the formula's recompute
    # term is an upper bound by exactly that matmul.
    fc2 = 2 * cfg.ffn_hidden_size * cfg.hidden_size * cfg.num_layers * 2 * cfg.seq_length
    assert counted_flops(cfg, 2) == pytest.approx(flops.total - fc2, rel=1e-6)
