"""The one seam every process group and collective passes: DeepSpeed's comm backend (wrapped through
megatron/ds_seams.py), through which our comm layer, DeepSpeed's engines, ZeRO and the pipeline's send/recv all go.

* ``new_group`` gets the run's --distributed-timeout-minutes: torch gives a group created without one its own default
  (30 minutes under gloo), so a hang in a group of ours or DeepSpeed's (pipeline grid, ZeRO, Ulysses) outlived the
  timeout the user set.
* Each collective records where the main thread waits (megatron/progress.py): op, group, its sequence number in that
  group. Asynchronous ops are recorded when issued, not while their handle is waited on.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from megatron import ds_seams
from megatron.progress import PROGRESS, Progress

_group_ids: dict[int, str] = {}


def group_id(group) -> str:
    """A process group's id, the same on every rank: torch names groups by creation order ("0" is the world)."""
    if group is None:
        return "0"
    key = id(group)
    gid = _group_ids.get(key)
    if gid is None:
        gid = _group_ids[key] = str(getattr(group, "group_name", key))
    return gid


def _tracked(op: str, fn, progress: Progress):
    spec = ds_seams.BACKEND_OPS[op]
    where = spec.position("group") if spec.group_by_position else None

    def call(*args, **kwargs):
        if torch.compiler.is_compiling():  # inside a compiled region: no Python side effects to trace
            return fn(*args, **kwargs)
        group = kwargs.get("group", args[where] if where is not None and len(args) > where else None)
        return _recorded(progress, op, group_id(group), fn, args, kwargs)

    call.__wrapped__ = fn
    return call


def _recorded(progress: Progress, op: str, key: str, fn, args, kwargs):
    """Run one collective with its progress recorded: entered, then left or failed."""
    before = progress.enter_collective(op, key)
    try:
        out = fn(*args, **kwargs)
    except BaseException as e:
        progress.collective_failed(e)
        raise
    progress.leave_collective(before)
    return out


def _tracked_p2p(op: str, fn, progress: Progress, rank: int):
    peer_key = ds_seams.BACKEND_OPS[op].peer
    where = ds_seams.BACKEND_OPS[op].position(peer_key)  # send(tensor, dst, ...) / recv(tensor, src, ...)

    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        peer = kwargs.get(peer_key, args[where] if len(args) > where else None)  # a global rank, whatever group
        lo, hi = sorted((rank, -1 if peer is None else int(peer)))
        return _recorded(progress, op, f"p2p:{lo}-{hi}", fn, args, kwargs)

    call.__wrapped__ = fn
    return call


def install(timeout: timedelta, track: bool = True, progress: Progress = PROGRESS) -> None:
    """Once, right after deepspeed.init_distributed: every later group gets ``timeout``; with ``track`` every
    collective records its progress. Idempotent (a second call in one process changes nothing)."""
    backend = ds_seams.unwrapped_comm_backend()
    if backend is None:
        return
    rank = torch.distributed.get_rank()
    _group_ids.clear()  # a new world (a test's second run in one process): torch names its groups afresh
    progress.counts = {"0": 0}

    def new_group(ranks):
        ranks = list(ranks)
        group = torch.distributed.new_group(ranks, timeout=timeout)
        if rank in ranks:
            progress.join_group(group_id(group))
        return group

    def tracked(op: str, fn):
        return _tracked_p2p(op, fn, progress, rank) if ds_seams.BACKEND_OPS[op].peer else _tracked(op, fn, progress)

    ds_seams.wrap_comm_backend(backend, new_group, tracked if track else None)


def tracked_call(op: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``: a collective that bypasses DeepSpeed's backend (torch's all_gather_object), recorded
    the same way; its group is ``kwargs["group"]``."""
    return _recorded(PROGRESS, op, group_id(kwargs.get("group")), fn, args, kwargs)
