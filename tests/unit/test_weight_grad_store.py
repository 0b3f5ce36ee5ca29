"""The weight-gradient store of zero-bubble H1 (megatron/core/tensor_parallel/weight_grad_store.py): a linear whose
weight gradient is deferred and applied later gives bit for bit the output and gradients of ``F.linear`` (input,
bias, weight; fp32 and bf16, [s, b, h] and 2-D inputs, contiguous or transposed, micro-batch 1 too, inside activation
checkpoints too), accumulates in the order W runs, fires the weight's hooks, and keeps its items FIFO under the
schedule's keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.recompute import CheckpointOptions, checkpoint, checkpoint_with
from megatron.core.tensor_parallel.weight_grad_store import WEIGHT_GRAD_STORE as STORE
from megatron.core.tensor_parallel.weight_grad_store import WeightGradStore, linear, run_weight_pass

CASES = [  # (input shape, out features, transposed input)
    ((16, 2, 32), 48, False), ((16, 2, 32), 48, True), ((40, 24), 8, False), ((128, 4, 256), 384, False),
    ((64, 3, 96), 160, True), ((16, 1, 64), 192, True),
]


@pytest.fixture(autouse=True)
def _empty_store():
    STORE.clear()
    yield
    STORE.clear()


def _inputs(shape, out, transposed, bias, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if transposed:  # a [b, s, in] tensor seen as [s, b, in]
        x = torch.randn(shape[1], shape[0], *shape[2:], generator=g).to(dtype).transpose(0, 1)
    else:
        x = torch.randn(*shape, generator=g).to(dtype)
    w = torch.randn(out, shape[-1], generator=g).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    grad = torch.randn(*shape[:-1], out, generator=g).to(dtype)
    return x, w, b, grad


def _leaves(x, w, b):
    out = [x.detach().clone().requires_grad_(), torch.nn.Parameter(w.clone())]
    return out + [torch.nn.Parameter(b.clone()) if b is not None else None]


def _grads(x, w, b):
    return x.grad, w.grad, None if b is None else b.grad


def _equal(a, b):
    assert all((u is None and v is None) or torch.equal(u, v) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape,out,transposed", CASES)
def test_deferred_weight_gradient_is_f_linear_bit_for_bit(shape, out, transposed, bias, dtype):
    x, w, b, grad = _inputs(shape, out, transposed, bias, dtype)
    ref = _leaves(x, w, b)
    y_ref = F.linear(*ref)
    y_ref.backward(grad)

    now = _leaves(x, w, b)  # through the wrapper, not deferring (a combined backward)
    y_now = linear(*now, defer=True)
    assert torch.equal(y_now, y_ref)  # the forward too: a transposed input is folded as with a trainable weight
    y_now.backward(grad)
    _equal(_grads(*now), _grads(*ref))

    later = _leaves(x, w, b)
    y = linear(*later, defer=True)
    with STORE.defer(key=(0, 0)):
        y.backward(grad)
    assert later[1].grad is None and STORE.pending() == 1
    _equal(_grads(*later)[::2], _grads(*ref)[::2])  # the input's and the bias's gradients come in B
    run_weight_pass(STORE.pop((0, 0)))
    assert torch.equal(later[1].grad, ref[1].grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_micro_batches_accumulate_in_the_order_w_runs(dtype):
    x0, w, b, g0 = _inputs((16, 2, 32), 48, False, True, dtype, seed=1)
    x1, _, _, g1 = _inputs((16, 2, 32), 48, False, True, dtype, seed=2)
    x0, x1 = x0.requires_grad_(), x1.requires_grad_()
    ref = torch.nn.Parameter(w.clone())
    for x, g in ((x0, g0), (x1, g1)):
        F.linear(x, ref).backward(g)
    ours = torch.nn.Parameter(w.clone())
    for mb, (x, g) in enumerate(((x0, g0), (x1, g1))):
        with STORE.defer(key=mb):
            linear(x, ours, None, defer=True).backward(g)
    run_weight_pass(STORE.pop(0))
    run_weight_pass(STORE.pop(1))
    assert torch.equal(ours.grad, ref.grad)


@pytest.mark.parametrize("options", [None, CheckpointOptions(), CheckpointOptions(cpu=True)],
                         ids=["checkpoint", "checkpoint_with", "checkpoint_with-cpu"])
def test_recomputed_layers_defer_what_their_replay_saved(options):
    x, w1, _, _ = _inputs((16, 2, 32), 32, False, False, torch.float32, seed=3)
    _, w2, _, grad = _inputs((16, 2, 32), 32, False, False, torch.float32, seed=4)

    def block(params, defer):
        def fn(h):
            return linear(torch.tanh(linear(h, params[0], None, defer)), params[1], None, defer)
        return fn

    ref = [torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())]
    xr = x.clone().requires_grad_()
    block(ref, False)(xr).backward(grad)
    ours = [torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())]
    xo = x.clone().requires_grad_()
    fn = block(ours, True)
    y = checkpoint(fn, xo) if options is None else checkpoint_with(fn, xo, options)
    with STORE.defer(key="mb0"):
        y.backward(grad)
    assert ours[0].grad is None and torch.equal(xo.grad, xr.grad)
    assert STORE.held_bytes() > 0  # the replay's inputs and output gradients, kept for W
    run_weight_pass(STORE.pop("mb0"))
    assert all(torch.equal(o.grad, r.grad) for o, r in zip(ours, ref, strict=True))
    assert STORE.held_bytes() == 0


def test_w_fires_the_weights_hooks_through_autograd():
    x, w, _, grad = _inputs((8, 2, 16), 8, False, False, torch.float32)
    x, p = x.requires_grad_(), torch.nn.Parameter(w.clone())
    seen = []
    p.register_hook(lambda g: seen.append("tensor") or g * 2)  # as the experts' sum over TP: before accumulation
    p.register_post_accumulate_grad_hook(lambda t: seen.append("accumulated"))  # as ZeRO's and bf16's
    with STORE.defer(key=0):
        linear(x, p, None, defer=True).backward(grad)
    assert seen == []
    run_weight_pass(STORE.pop(0))
    assert seen == ["tensor", "accumulated"]
    assert torch.equal(p.grad, 2 * grad.reshape(-1, 8).t().mm(x.detach().reshape(-1, 16)))


def test_keys_are_fifo_and_clear_empties():
    store = WeightGradStore()
    for key in ("a", "b"):
        with store.defer(key):
            pass
    with pytest.raises(RuntimeError, match="oldest deferred pass is a"):
        store.pop("b")
    store.clear()
    assert store.pending() == 0 and not store.deferring
    with pytest.raises(RuntimeError, match="nothing deferred"):
        store.pop("a")
    with pytest.raises(RuntimeError, match="nested"), store.defer("x"), store.defer("y"):
        pass
    with pytest.raises(ValueError), store.defer("z"):  # a failed B leaves no W item behind
        raise ValueError
    assert store.pending() == 0 and not store.deferring


def test_a_weight_twice_in_one_pass_is_refused_and_plain_calls_never_defer():
    x, w, _, grad = _inputs((8, 2, 16), 8, False, False, torch.float32)
    p = torch.nn.Parameter(w.clone())
    with torch.no_grad():
        assert linear(x, p, None, defer=True).grad_fn is None
    assert type(linear(x, p, None, defer=True).grad_fn).__name__ != "_WeightGradSplitBackward"  # nothing upstream
    x.requires_grad_()
    twice = linear(x, p, None, True) + linear(x, p, None, True)
    with pytest.raises(RuntimeError, match="deferred twice"), STORE.defer(key=0):
        twice.backward(grad)
