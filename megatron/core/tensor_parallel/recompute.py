"""Activation checkpointing that also replays the TP RNG tracker, so dropout masks match on recompute.

``torch.utils.checkpoint`` restores the default CPU/device RNG before recomputing, but our tracker keeps the
TP-forked stream (attention dropout, sequence-parallel dropout) as a saved state tensor of its own. Without
restoring it, the recompute draws different masks than the forward did (wrong gradients), and it advances
the tracker a second time (different masks for every later layer). ``checkpoint`` snapshots the tracker
when the forward runs and swaps that snapshot in for the recompute only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.utils.checkpoint

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
