"""Activation recompute: identical loss and gradients (with dropout on, so RNG replay is tested), and fewer
activation bytes kept for the backward, measured with saved_tensors_hooks."""

import pytest
import torch

from megatron.config import ModelConfig
from megatron.core.parallel_state import single_process_state
from megatron.core.tensor_parallel.random import set_seeds
from megatron.model.gpt_model import GPTModel
from megatron.perf.saved_tensors import saved_activation_bytes

TOL = 1e-6


def _cfg(granularity, **kw) -> ModelConfig:
    fields = dict(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=100,
                  make_vocab_size_divisible_by=64, use_cpu_initialization=True, hidden_dropout=0.2,
                  attention_dropout=0.2, recompute_granularity=granularity, attention_backend="torch")
    fields.update(kw)
    return ModelConfig(**fields)


def _loss_and_grads(cfg: ModelConfig, steps: int = 2):
    """Two forward/backward passes from the same seeds; dropout draws from both the default and TP streams."""
    set_seeds(11)
    model = GPTModel(cfg, tp=single_process_state().tp, init_seed=3)
    gen = torch.Generator().manual_seed(0)
    losses, grads = [], {}
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=gen)
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        loss.backward()
        losses.append(loss.item())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return losses, grads


def _max_diff(a, b) -> float:
    losses = max(abs(x - y) for x, y in zip(a[0], b[0], strict=True))
    grads = max((a[1][n] - b[1][n]).abs().max().item() for n in a[1])
    return max(losses, grads)


@pytest.mark.parametrize("granularity,extra", [("full", {}), ("full", {"recompute_num_layers": 2}),
                                               ("selective", {}), ("full", {"num_key_value_heads": 2,
                                                                            "normalization": "rmsnorm",
                                                                            "swiglu": True,
                                                                            "position_embedding_type": "rope"})])
def test_recompute_leaves_loss_and_grads_unchanged(granularity, extra):
    ref = _loss_and_grads(_cfg(None, **extra))
    assert _max_diff(ref, _loss_and_grads(_cfg(granularity, **extra))) <= TOL


def test_tracker_replay_is_what_makes_it_exact(monkeypatch):
    """Negative control: torch's checkpoint alone does not replay our TP RNG tracker, and the grads move."""
    from megatron.model import attention

    ref = _loss_and_grads(_cfg(None))
    monkeypatch.setattr(attention, "checkpoint",
                        lambda fn, *args: torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False))
    assert _max_diff(ref, _loss_and_grads(_cfg("selective"))) > 1e-4


def _saved_bytes(cfg: ModelConfig) -> int:
    torch.manual_seed(0)
    model = GPTModel(cfg, tp=single_process_state().tp, init_seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length + 1))
    return saved_activation_bytes(model, lambda: model(tokens[:, :-1], tokens[:, 1:]).mean())


def test_recompute_lowers_saved_activation_memory():
    shape = dict(num_layers=4, seq_length=128, vocab_size=120)
    none, full, selective = (_saved_bytes(_cfg(g, **shape)) for g in (None, "full", "selective"))
    print(f"\nsaved activation bytes: none {none}, full {full} ({full / none:.3f}x), "
          f"selective {selective} ({selective / none:.3f}x)")
    assert full < 0.35 * none
    assert selective < 0.75 * none
