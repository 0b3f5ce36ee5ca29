"""Weight gradients deferred from a pipeline's backward pass to a later weight pass (zero-bubble H1): the store the
engine's B pass fills and its W pass empties, and the linear whose weight gradient it can defer.

Upstream Megatron-DeepSpeed's WeightGradStore (megatron/core/tensor_parallel/weight_grad_store.py) keeps
``(input, grad_output, weight, func)`` and writes ``weight.grad`` itself. Here an entry is ``(param, compute)``
(the stand-in layers of bench/pipeline_schedules.py use the same path) and W hands the gradients to autograd on the
leaves, so every hook accumulation triggers still fires in order: ZeRO's gradient copy, the bf16 optimizer's
immediate update, the experts' sum over TP. The linear keeps a reference to the input autograd itself saved (under
sequence parallelism the all-gathered one, never a shared buffer, which is why upstream had to refuse SP).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

Compute = Callable[[], torch.Tensor]


class WeightGradStore:
    """One W item per B-only pass, kept FIFO under the key the schedule gives it (its chunk and micro-batch)."""

    def __init__(self) -> None:
        self.deferring = False
        self._items: list[tuple[torch.Tensor, Compute, tuple[torch.Tensor, ...]]] | None = None
        self._queue: deque = deque()

    @contextlib.contextmanager
    def defer(self, key) -> Iterator[None]:
        """Within, ``put`` collects weight gradients instead of computing them; on a normal exit they become one W
        item under ``key`` (possibly empty: a stage whose layers defer nothing)."""
        if self.deferring:
            raise RuntimeError("WeightGradStore.defer: already deferring (nested B passes)")
        self.deferring, self._items = True, []
        try:
            yield
            self._queue.append((key, self._items))
        finally:
            self.deferring, self._items = False, None

    def put(self, param: torch.Tensor, compute: Compute, held: tuple[torch.Tensor, ...] = ()) -> None:
        """Defer ``param``'s gradient: ``compute()`` returns it; ``held`` are the tensors it keeps alive (counted by
        ``held_bytes``)."""
        if any(p is param for p, _, _ in self._items):  # one W item accumulates each weight once
            raise RuntimeError("WeightGradStore.put: a weight deferred twice in one backward pass")
        self._items.append((param, compute, held))

    def pop(self, key) -> list[tuple[torch.Tensor, Compute]]:
        """The oldest W item, which must be ``key``'s (the schedule runs W in B order)."""
        if not self._queue:
            raise RuntimeError(f"WeightGradStore.pop({key}): nothing deferred")
        head, items = self._queue.popleft()
        if head != key:
            raise RuntimeError(f"WeightGradStore.pop({key}): the oldest deferred pass is {head} (W out of order)")
        return [(p, fn) for p, fn, _ in items]

    def pending(self) -> int:
        return len(self._queue)

    def held_storages(self, newest_only: bool = False) -> dict[int, int]:
        """The distinct storages the pending items (or the newest one) keep alive: address -> bytes."""
        seen: dict[int, int] = {}
        for _, items in list(self._queue)[-1:] if newest_only else self._queue:
            for _, _, held in items:
                for t in held:
                    storage = t.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
        return seen

    def held_bytes(self) -> int:
        return sum(self.held_storages().values())

    def clear(self) -> None:
        """Drop everything (a new step; after an exception)."""
        self._queue.clear()
        self.deferring, self._items = False, None


WEIGHT_GRAD_STORE = WeightGradStore()
"""The process-wide store (one pipeline engine per process runs at a time), like the RNG tracker."""


def run_weight_pass(items: list[tuple[torch.Tensor, Compute]]) -> None:
    """Compute ``items``' gradients and accumulate them through autograd (leaves: their hooks, then ``.grad``)."""
    if items:
        torch.autograd.backward([p for p, _ in items], [fn() for _, fn in items])


class _WeightGradSplit(torch.autograd.Function):
    """``y`` (= ``F.linear(x, w.detach(), b)``: autograd gives x and the bias their gradients, bit for bit as with a
    trainable w) -> ``y``; the backward adds w's gradient ``g^T x`` to it through ``run_weight_pass``, now or, while
    the store defers, in W. The weight rides outside autograd's inputs (in a list): an input whose gradient is
    returned as None would still run its hooks (with None) and DeepSpeed's accumulation hooks in B."""

    @staticmethod
    def forward(ctx, y, x, weight: list):
        ctx.save_for_backward(x)
        ctx.weight = weight[0]
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        w = ctx.weight

        def compute() -> torch.Tensor:  # autograd's own GEMM for F.linear's weight: [out, N] x [N, in]
            return grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))

        if WEIGHT_GRAD_STORE.deferring:
            WEIGHT_GRAD_STORE.put(w, compute, (x, grad))
        else:
            run_weight_pass([(w, compute)])
        return grad, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, defer: bool) -> torch.Tensor:
    """``F.linear``; with ``defer`` (and a trainable weight under grad mode) the weight's gradient goes through
    ``_WeightGradSplit``, whose backward defers it while the store does. Its backward runs only if the input or the
    bias takes a gradient too (in our layers always: the input comes out of the embedding or the previous stage)."""
    backward = x.requires_grad or (bias is not None and bias.requires_grad)
    if defer and backward and weight.requires_grad and torch.is_grad_enabled():
        return _WeightGradSplit.apply(_linear_as_if_trainable(x, weight.detach(), bias), x, [weight])
    return F.linear(x, weight, bias)


def _linear_as_if_trainable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as it is when ``weight`` requires a gradient, bit for bit (output and
    the input's gradient). F.linear without a contiguous input and a bias goes through ``matmul``, which folds an
    input of 3+ dims into one GEMM when the weight requires a gradient but, for a detached weight and leading dims
    that do not fold without a copy (an [s, b, h] view of a [b, s, h] tensor; Llama's RMSNorm keeps that layout),
    runs a batched GEMM that rounds differently: exact ZB-H1 was ~1e-7 off 1F1B through that alone."""
    if x.dim() < 3 or (bias is not None and x.is_contiguous()):  # F.linear's paths that ignore requires_grad
        return F.linear(x, weight, bias)
    y = x.reshape(-1, x.shape[-1]).mm(weight.t()).view(*x.shape[:-1], weight.shape[0])  # matmul's fold
    return y if bias is None else y + bias
