"""The project's collective calls, all routed through ``deepspeed.comm``.

One module so that (a) no model code names a backend (gloo on CPU, RCCL on Frontier, NCCL elsewhere)
and (b) a byte counter can observe every collective we issue (see ``megatron/perf`` tests).
Gloo lacks reduce-scatter, so that one falls back to all-reduce + slice there.

The placement rule: NCCL and RCCL take device tensors only ("No backend type associated with device type
cpu"), gloo takes host tensors. Every tensor collective here refuses a tensor on the wrong side of that line
with a message naming the rule, and host values (flags, scalars, ids) go through ``reduce_host``, which stages
them on ``collective_device`` and reads the result back with one device->host copy.
"""

from __future__ import annotations

from collections.abc import Callable

import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator

from megatron.core.tracking import tracked_call

# Observers called as fn(op_name, tensor_bytes, group) before each collective; used by byte counters.
_observers: list[Callable[[str, int, object], None]] = []


def add_observer(fn: Callable[[str, int, object], None]) -> Callable[[], None]:
    """Register a collective observer; returns a function that removes it."""
    _observers.append(fn)
    return lambda: _observers.remove(fn)


def _notify(op: str, t: torch.Tensor, group) -> None:
    _check_placement(op, t, group)
    for fn in _observers:
        fn(op, t.numel() * t.element_size(), group)


def world_size(group=None) -> int:
    return dist.get_world_size(group=group)


def rank(group=None) -> int:
    return dist.get_rank(group=group)


def _gloo(group) -> bool:
    return "gloo" in str(torch.distributed.get_backend(group)).lower()


def collective_device(group=None) -> torch.device:
    """Where a tensor for a collective over ``group`` must live: the host under gloo, else the accelerator
    device this process drives (initialize_distributed set it before the process group existed)."""
    if _gloo(group):
        return torch.device("cpu")
    return torch.device(get_accelerator().current_device_name())


def accelerator_device_type() -> str:
    """The accelerator's device type: "cuda" (also on ROCm), "cpu", "xpu", ... (no device index)."""
    return get_accelerator().device_name().split(":")[0]


def _check_placement(op: str, t: torch.Tensor, group) -> None:
    if t.device.type == "cpu" and not _gloo(group):
        raise RuntimeError(f"{op} of a host tensor {tuple(t.shape)} on a {torch.distributed.get_backend(group)} "
                           "group: NCCL/RCCL take device tensors only; stage host values with comm.reduce_host "
                           "or move the tensor to comm.collective_device(group)")


def _readback(t: torch.Tensor) -> list:
    """The one device->host copy (a host sync on an accelerator) of a staged collective result."""
    return t.tolist()


def stage(values, group=None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Host numbers and/or one-element tensors (any device) -> one flat tensor [n] on ``collective_device``.
    Host numbers travel in one non-blocking copy; device tensors never visit the host."""
    dev = collective_device(group)
    numbers = [float(v) if dtype.is_floating_point else int(v) for v in values if not isinstance(v, torch.Tensor)]
    host = iter(torch.tensor(numbers, dtype=dtype).to(dev, non_blocking=True)) if numbers else iter(())
    parts = [v.detach().reshape(1).to(dev, dtype) if isinstance(v, torch.Tensor) else next(host).reshape(1)
             for v in values]
    return torch.cat(parts)


def reduce_host(values, group=None, op=None, dtype: torch.dtype = torch.float64, also=()) -> list:
    """All-reduce a few values (sum, or ``op``) over ``group`` and return them as Python numbers.

    ``values``: host numbers and/or one-element tensors. They are staged where the backend wants them
    (device for NCCL/RCCL, host for gloo); the read-back is the only host sync. ``also``: this rank's own
    one-element tensors (not reduced) read back in the same copy, appended to the result."""
    t = stage(values, group, dtype)
    all_reduce(t, group, op)
    return to_host(*t.unbind(), *also) if also else _readback(t)


def to_host(*values) -> list:
    """One-element tensors (one device) -> Python numbers in a single device->host copy; numbers and None
    pass through. For the step's log values: one sync per iteration, however many values."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return list(values)
    dev = tensors[0].device
    read = iter(_readback(torch.cat([v.detach().reshape(1).to(dev, torch.float64) for v in tensors])))
    return [next(read) if isinstance(v, torch.Tensor) else v for v in values]


def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable ``obj`` in rank order. Under NCCL/RCCL torch stages the pickle on the current
    device: initialize_distributed calls ``set_device(local_rank)`` before creating the process group, so
    that is this rank's own device and not device 0 for every rank."""
    out = [None] * world_size(group)
    tracked_call("all_gather_object", torch.distributed.all_gather_object, out, obj, group=group)
    return out


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


def isend(t: torch.Tensor, dst: int, group=None):
    """Post a send of ``t`` to global rank ``dst`` (in ``group``) without waiting; returns its work handle (keep
    ``t`` alive and unchanged until it completes)."""
    _notify("send", t, group)
    return dist.isend(t, dst, group=group)


def recv(t: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """Receive into ``t`` from global rank ``src`` (in ``group``), waiting for it."""
    dist.recv(t, src, group=group)
    return t


def barrier(group=None) -> None:
    dist.barrier(group=group)
