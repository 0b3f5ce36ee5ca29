"""Activation checkpointing that also replays the TP RNG tracker, so dropout masks match on recompute.

``torch.utils.checkpoint`` restores the default CPU/device RNG before recomputing, but our tracker keeps the
TP-forked stream (attention dropout, sequence-parallel dropout) as a saved state tensor of its own. Without
restoring it, the recompute draws different masks than the forward did (wrong gradients), and it advances
the tracker a second time (different masks for every later layer). ``checkpoint`` snapshots the tracker
when the forward runs and swaps that snapshot in for the recompute only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils.checkpoint

from megatron.core import comm
from megatron.core.tensor_parallel.random import get_rng_tracker


def _tracker_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    tracker = get_rng_tracker()
    at_forward: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def forward():
        at_forward.update(tracker.get_states())
        yield

    @contextlib.contextmanager
    def recompute():
        # Replay from the forward-time snapshot, then put the live stream back untouched.
        live = tracker.get_states()
        tracker.set_states(at_forward)
        try:
            yield
        finally:
            tracker.set_states(live)

    return forward(), recompute()


def checkpoint(function: Callable, *args: torch.Tensor):
    """``function(*args)`` keeping only ``args`` for the backward (non-reentrant), RNG-exact on recompute."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                                             context_fn=_tracker_contexts)


@dataclass(frozen=True)
class CheckpointOptions:
    """What DeepSpeed's activation-checkpointing options mean, done around our RNG-exact ``checkpoint``.

    partition: keep only this rank's 1/TP of a checkpoint's input (DeepSpeed's partition_activations,
    Megatron's --distribute-saved-activations) and all-gather it for the recompute. The slice is a copy and
    the caller's tensor is never shrunk in place, so a residual that reuses the input stays intact.
    cpu: keep the saved input in host memory (cpu_checkpointing / --checkpoint-in-cpu).
    synchronize: accelerator synchronize at the start and end of each checkpoint's forward and backward.
    profile: print each checkpoint's forward and backward (recompute included) time on rank 0.
    """

    partition: bool = False
    cpu: bool = False
    synchronize: bool = False
    profile: bool = False

    @property
    def plain(self) -> bool:
        return not (self.partition or self.cpu or self.synchronize or self.profile)


class _KeepShard(torch.autograd.Function):
    """[any] -> this rank's 1/TP of the flattened tensor (a copy); the backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group):

        ctx.group, ctx.shape = group, x.shape
        return x.detach().reshape(-1).chunk(comm.world_size(group))[comm.rank(group)].clone()

    @staticmethod
    def backward(ctx, grad):

        return comm.all_gather(grad.contiguous(), ctx.group).reshape(ctx.shape), None


class _Unshard(torch.autograd.Function):
    """The inverse inside the checkpoint: all-gather the shards; the backward keeps this rank's slice (the
    gradient of a TP-replicated input is the same on every rank, so the slices make it whole again)."""

    @staticmethod
    def forward(ctx, shard, group, shape):

        ctx.n, ctx.r = comm.world_size(group), comm.rank(group)
        return comm.all_gather(shard.contiguous(), group).reshape(shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(-1).chunk(ctx.n)[ctx.r].clone(), None, None


class _Boundary(torch.autograd.Function):
    """Identity marking a checkpoint's start (``start=True``: input side) or end, for synchronize/profile."""

    @staticmethod
    def forward(ctx, x, options, start, clock):
        ctx.options, ctx.start, ctx.clock = options, start, clock
        _boundary(options, clock, "forward", start)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _boundary(ctx.options, ctx.clock, "backward", not ctx.start)  # the backward enters at the output
        return grad, None, None, None


def _boundary(options: CheckpointOptions, clock: dict, phase: str, start: bool) -> None:
    if options.synchronize or options.profile:
        from deepspeed.accelerator import get_accelerator

        get_accelerator().synchronize()
    if options.profile:
        if start:
            clock[phase] = time.perf_counter()
        elif not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            ms = (time.perf_counter() - clock.pop(phase)) * 1e3
            print(f"> activation checkpoint {phase}{' (with recompute)' if phase == 'backward' else ''}: "
                  f"{ms:.3f} ms", flush=True)


def checkpoint_with(function: Callable, x: torch.Tensor, options: CheckpointOptions, tp_group=None,
                    tp_size: int = 1) -> torch.Tensor:
    """``checkpoint(function, x)`` with DeepSpeed's activation-checkpointing options (see CheckpointOptions)."""
    if options.plain:
        return checkpoint(function, x)
    clock: dict[str, float] = {}
    device, shape = x.device, x.shape
    x = _Boundary.apply(x, options, True, clock)
    saved = _KeepShard.apply(x, tp_group) if options.partition and tp_size > 1 else x
    saved = saved.to("cpu") if options.cpu else saved  # differentiable; a no-op on a CPU accelerator
    # A device tensor among the inputs makes torch.utils.checkpoint save and replay the device's RNG too, even
    # when the saved input itself lives on the host.
    anchor = torch.empty(0, device=device)

    def run(kept: torch.Tensor, _anchor: torch.Tensor) -> torch.Tensor:
        full = kept.to(device)
        if full.shape != shape:
            full = _Unshard.apply(full, tp_group, shape)
        return function(full)

    out = checkpoint(run, saved, anchor)
    return _Boundary.apply(out, options, False, clock)
