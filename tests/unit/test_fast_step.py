"""The training-step pieces of issue 15 on CPU: fused AdamW only where a device has it (CPU numerics
unchanged), fused bias-GeLU / bias-dropout-add equal to the unfused ops, the memory-lean cross entropy
equal to the reference, and --compile wired to the layers (with a stand-in for torch.compile)."""

from __future__ import annotations

import torch

from megatron.config import OptimizerConfig
from megatron.training import optimizer as optim


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]


def test_adamw_fused_only_off_cpu_and_cpu_update_unchanged():
    o = OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_beta2=0.95)
    assert optim.fused_supported("cuda") and not optim.fused_supported("cpu")
    ours, ref = _params(), _params()
    opt = optim.make_adamw([{"params": ours, "weight_decay": 0.1}], o, device_type="cpu")
    ref_opt = torch.optim.AdamW([{"params": ref, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    assert not opt.param_groups[0]["fused"]
    for step in range(3):
        for a, b in zip(ours, ref, strict=True):
            a.grad = b.grad = torch.full_like(a, 0.5 + step)
        opt.step()
        ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    # On an accelerator the same call asks for torch's fused kernel (not run here: no device).
    seen = {}
    real = torch.optim.AdamW
    try:
        torch.optim.AdamW = lambda params, **kw: seen.update(kw) or real(params, lr=kw["lr"])
        optim.make_adamw(_params(), o, device_type="cuda")
    finally:
        torch.optim.AdamW = real
    assert seen.get("fused") is True and seen["betas"] == (0.9, 0.95)
