"""Zero-bubble H1's deferred weight gradient on the device's GEMMs: exact ZB-H1 (--enable-zbh1-exact-semantics) is
bit-identical to 1F1B only if the deferring linear gives ``F.linear``'s output and gradients bit for bit there too
(input and bias in B, weight in W; fp32, bf16, fp16; with and without a bias; [s, b, h] and 2-D inputs, contiguous or
transposed). The CPU twin is tests/unit/test_weight_grad_store.py (these cases)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.weight_grad_store import WEIGHT_GRAD_STORE as STORE
from megatron.core.tensor_parallel.weight_grad_store import linear, run_weight_pass
from tests.unit.test_weight_grad_store import CASES, _grads, _inputs, _leaves


def _on_device(*tensors):
    device = torch.device("cuda", torch.cuda.current_device())  # ROCm torch names its devices "cuda" too
    return [None if t is None else t.to(device) for t in tensors]


def _same(got, ref, what: str) -> None:
    for name, u, v in zip(("input", "weight", "bias"), got, ref, strict=True):
        assert (u is None and v is None) or torch.equal(u, v), f"{what}: the {name} gradient differs from F.linear's"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape,out,transposed", CASES)
def test_deferred_weight_gradient_is_f_linear_bit_for_bit_on_the_device(shape, out, transposed, bias, dtype):
    STORE.clear()
    x, w, b, grad = _on_device(*_inputs(shape, out, transposed, bias, dtype))
    ref = _leaves(x, w, b)
    y_ref = F.linear(*ref)
    y_ref.backward(grad)
    later = _leaves(x, w, b)
    y = linear(*later, defer=True)
    assert torch.equal(y, y_ref), f"{tuple(shape)} -> {out}, {dtype}: the output differs from F.linear's"
    with STORE.defer(key=(0, 0)):
        y.backward(grad)
    assert later[1].grad is None and STORE.pending() == 1
    run_weight_pass(STORE.pop((0, 0)))
    _same(_grads(*later), _grads(*ref), f"{tuple(shape)} -> {out}, {dtype}")
