"""What a pipeline stage holds for its backward, counted by the engine itself between instructions: the distinct
storages autograd saved in each buffer's forward (until that buffer's backward), plus the weight-gradient inputs the
zero-bubble store keeps until W. The zero-bubble engine counts its first step to size its memory cap
(deferral_cap.py); tests and bench/pipeline_schedules.py count every step (works on DeepSpeed's 1F1B engine too)."""

from __future__ import annotations

import torch

from megatron import ds_seams
from megatron.core.tensor_parallel.weight_grad_store import WEIGHT_GRAD_STORE

_BACKWARDS = ("BackwardPass", "BackwardInputPass")


class HeldMemory:
    """Installed on one pipeline engine (its own instruction map); ``peak``: the most bytes held at once;
    ``forward_bytes`` / ``deferred_bytes``: the most one micro-batch's forward saved / one B left for its W.
    Counts while ``counting``."""

    def __init__(self, engine) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
        self.saved: dict[int, dict[int, int]] = {}  # buffer -> storage address -> bytes
        self.peak = self.forward_bytes = self.deferred_bytes = 0
        self.counting, self.every_step = True, False
        ds_seams.wrap_pipeline_instructions(engine, self._wrap)

    @classmethod
    def on(cls, engine) -> HeldMemory:
        """``engine``'s counter, counting every step from now on: the zero-bubble engine's own (one counter per
        engine: saved-tensor hooks do not nest), else a new one."""
        counter = getattr(engine, "held_memory", None) or cls(engine)
        counter.counting = counter.every_step = True
        return counter

    def reset(self) -> None:
        self.saved, self.peak = {}, 0

    def held(self) -> int:
        union: dict[int, int] = dict(WEIGHT_GRAD_STORE.held_storages())
        for storages in self.saved.values():
            union.update(storages)
        return sum(union.values())

    def _wrap(self, kind: type, fn):
        name = kind.__name__

        def run(engine, *args, **kwargs):
            if not self.counting:
                return fn(engine, *args, **kwargs)
            buffer_id = kwargs.get("buffer_id", args[0] if args else None)
            if name == "ForwardPass" and torch.is_grad_enabled():
                seen: dict[int, int] = {}

                def pack(t: torch.Tensor) -> torch.Tensor:
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in self.params and storage.nbytes():
                        seen[storage.data_ptr()] = storage.nbytes()
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = fn(engine, *args, **kwargs)
                self.saved[buffer_id] = seen
                self.forward_bytes = max(self.forward_bytes, sum(seen.values()))
            else:
                out = fn(engine, *args, **kwargs)
                if name in _BACKWARDS:
                    self.saved.pop(buffer_id, None)
                if name == "BackwardInputPass":
                    newest = WEIGHT_GRAD_STORE.held_storages(newest_only=True)
                    self.deferred_bytes = max(self.deferred_bytes, sum(newest.values()))
            self.peak = max(self.peak, self.held())
            return out

        return run
