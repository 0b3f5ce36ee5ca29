"""Measure the activation memory a forward pass keeps for its backward, device-independently.

Counts the distinct storages autograd packs (``saved_tensors_hooks``) that are not parameters. With
non-reentrant checkpointing the checkpoint's own inputs are packed by the outer hook, while the tensors
inside a checkpointed region are not kept at all, so the total is what the recompute saves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def saved_activation_bytes(model: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> int:
    """Run ``forward()`` (returning a scalar loss) then its backward; bytes of saved non-parameter storages."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    loss.backward()
    return sum(seen.values())
