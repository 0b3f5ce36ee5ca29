"""The training step makes no host sync, checked by CUDA's own sync detector (torch.cuda.set_sync_debug_mode).

The CPU twin (tests/unit/test_collective_placement.py) counts Python-level .item()/.cpu()/.tolist() calls with
the same fake engine and model; here the device itself says whether anything waited for it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.unit.test_collective_placement import _PlainEngine


@pytest.fixture
def sync_errors():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _single():
    one = SimpleNamespace(size=1, rank=0, group=None)
    return SimpleNamespace(tp=one, mp=one, dp=one)


class _MseNet(torch.nn.Module):
    """Linear layers only: torch's own embedding backward reads a segment count back to the host (a sync that is
    not ours), so this model avoids embeddings and class indices altogether."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(6)))

    def forward(self, x, y):  # [b, 16] -> per-element loss [b, 16]
        return (self.layers(x) - y).pow(2)


def test_train_step_and_grad_norm_do_not_sync(monkeypatch):
    from megatron.core import comm
    from megatron.training.step import train_step

    torch.manual_seed(0)
    dev = torch.device("cuda", torch.cuda.current_device())
    model = _MseNet().to(dev)
    engine = _PlainEngine(model, _single())
    batches = iter([{"x": torch.randn(4, 16, device=dev), "y": torch.randn(4, 16, device=dev)} for _ in range(2)])
    monkeypatch.setattr(comm, "all_reduce", lambda t, group=None, op=None: t)  # one process, no process group
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # any synchronizing call in the step raises
        res = train_step(engine, batches, num_microbatches=2, forward_step=lambda e, b: e(b["x"], b["y"]).mean())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = torch.cat([p.grad.double().reshape(-1) for p in model.parameters()]).norm().item()
    assert res.grad_norm == pytest.approx(ref, rel=1e-9)  # the one read-back, after the step


def test_hierarchical_zero_clip_does_not_sync(sync_errors):
    from megatron.core.hierarchical_zero.engine import HierarchicalZeroEngine

    dev = torch.device("cuda", torch.cuda.current_device())
    grad = torch.full((64,), 3.0, device=dev)
    fake = SimpleNamespace(counted=torch.ones(64, dtype=torch.bool, device=dev), h=SimpleNamespace(dp_size=1),
                           mpu=_single(), clip_grad=1.0)
    norm = HierarchicalZeroEngine._clip(fake, grad)
    torch.cuda.set_sync_debug_mode("default")
    assert norm.item() == pytest.approx(24.0)  # sqrt(64 * 9)
    assert grad.norm().item() == pytest.approx(1.0, rel=1e-5)  # clipped to clip_grad
