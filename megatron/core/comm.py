"""The project's collective calls, all routed through ``deepspeed.comm``.

One module so that (a) no model code names a backend (gloo on CPU, RCCL on Frontier, NCCL elsewhere)
and (b) a byte counter can observe every collective we issue (see ``megatron/perf`` tests).
Gloo lacks reduce-scatter, so that one falls back to all-reduce + slice there.
"""

from __future__ import annotations

from collections.abc import Callable

import deepspeed.comm as dist
import torch

# Observers called as fn(op_name, tensor_bytes, group) before each collective; used by byte counters.
_observers: list[Callable[[str, int, object], None]] = []


def add_observer(fn: Callable[[str, int, object], None]) -> Callable[[], None]:
    """Register a collective observer; returns a function that removes it."""
    _observers.append(fn)
    return lambda: _observers.remove(fn)


def _notify(op: str, t: torch.Tensor, group) -> None:
    for fn in _observers:
        fn(op, t.numel() * t.element_size(), group)


def world_size(group=None) -> int:
    return dist.get_world_size(group=group)


def rank(group=None) -> int:
    return dist.get_rank(group=group)


def _gloo(group) -> bool:
    return "gloo" in str(torch.distributed.get_backend(group)).lower()


def all_reduce(t: torch.Tensor, group=None, op=None) -> torch.Tensor:
    """In-place sum (or ``op``) over ``group``; returns ``t``. Non-contiguous tensors are copied first
    (gloo segfaults on stride-0 expanded tensors)."""
    if not t.is_contiguous():
        c = t.contiguous()
        all_reduce(c, group, op)
        t.copy_(c)
        return t
    _notify("all_reduce", t, group)
    dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.SUM, group=group)
    return t


def all_gather(t: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim`` (rank order)."""
    n = world_size(group)
    t = t.contiguous()
    _notify("all_gather", t, group)
    out = torch.empty((n * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    if _gloo(group):
        dist.all_gather(list(out.chunk(n)), t, group=group)
    else:
        dist.all_gather_into_tensor(out, t, group=group)
    if dim != 0:
        out = torch.cat(out.chunk(n), dim=dim)
    return out


def reduce_scatter(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over ``group``, then keep this rank's slice of dim 0."""
    n = world_size(group)
    t = t.contiguous()
    _notify("reduce_scatter", t, group)  # counted as the logical op, whatever gloo does below
    if _gloo(group):
        buf = t.clone()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        return buf.chunk(n)[rank(group)].contiguous()
    out = torch.empty((t.shape[0] // n,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.reduce_scatter_tensor(out, t, group=group)
    return out


def all_to_all(t: torch.Tensor, group=None) -> torch.Tensor:
    """Split dim 0 into ``n`` equal chunks; chunk ``j`` goes to rank ``j``, which returns them in rank order."""
    t = t.contiguous()
    _notify("all_to_all", t, group)
    out = torch.empty_like(t)
    dist.all_to_all_single(out, t, group=group)
    return out


def broadcast(t: torch.Tensor, src: int, group=None) -> torch.Tensor:
    _notify("broadcast", t, group)
    dist.broadcast(t, src, group=group)
    return t


def barrier(group=None) -> None:
    dist.barrier(group=group)
