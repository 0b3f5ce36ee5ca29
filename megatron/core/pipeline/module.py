"""A DeepSpeed ``PipelineModule`` whose rank holds ``v`` model chunks (Megatron's interleaved layout), one exposed to
``forward`` at a time, as DeepSpeed's own DualPipeVModule holds two (deepspeed/runtime/pipe/dualpipev.py).

The layer specs are split over ``p * v`` virtual stages (``parts``, p * v + 1 boundaries, set by the subclass's
partition); chunk ``c`` of rank ``r`` is virtual stage ``c * p + r``. Every layer keeps its global spec index as its
module name and checkpoint file name (``layer_XX-model_YY-model_states.pt``), so the files are today's, whatever v
and whoever wrote them. With v = 1 this is DeepSpeed's PipelineModule.
"""

from __future__ import annotations

from deepspeed.pipe import PipelineModule

from megatron import ds_seams


class ChunkedPipelineModule(PipelineModule):
    """``virtual_stages``: chunks per rank (v). The engine activates a chunk (``activate_chunk``) before each of its
    forward and backward passes; outside, chunk 0 is active. ``parts``: the p x v + 1 boundaries of the virtual
    stages in the layer specs (None: DeepSpeed's ``partition_method`` splits them over the p stages, v = 1)."""

    def __init__(self, layers, *, virtual_stages: int = 1, parts: list[int] | None = None, **kwargs) -> None:
        self.num_chunks, self._chunk_parts = virtual_stages, parts
        if parts is None and virtual_stages > 1:
            raise ValueError(f"ChunkedPipelineModule: {virtual_stages} chunks per rank need the virtual stages' parts")
        super().__init__(layers, **kwargs)

    def _partition_layers(self, method: str = "parameters") -> None:
        # Replaces DeepSpeed's (registered in megatron/ds_seams.py OVERRIDES) when the split is given: GPTModelPipe's
        # is analytic (DeepSpeed's 'parameters' builds every layer to count it) and puts the remainder first.
        if self._chunk_parts is None:
            super()._partition_layers(method)
        else:
            ds_seams.set_pipeline_partition(self, self._chunk_parts)

    def chunk_bounds(self, chunk: int) -> tuple[int, int]:
        """The spec range [start, stop) of this rank's ``chunk``."""
        p = self.topology().get_dim("pipe")
        vs = chunk * p + self.stage_id
        return self.parts[vs], self.parts[vs + 1]

    def virtual_stage(self, chunk: int) -> int:
        return chunk * self.topology().get_dim("pipe") + self.stage_id

    def is_last_virtual_stage(self) -> bool:
        """The active chunk computes the loss."""
        return self.virtual_stage(self.active_chunk) == len(self.parts) - 2

    def _build(self) -> None:
        # Replaces DeepSpeed's (registered in megatron/ds_seams.py OVERRIDES): its build, once per chunk.
        self.chunk_funcs = []
        for chunk in range(self.num_chunks):
            ds_seams.set_layer_bounds(self, *self.chunk_bounds(chunk))
            self.forward_funcs = []
            super()._build()
            self.chunk_funcs.append(self.forward_funcs)
        self.activate_chunk(0)

    def activate_chunk(self, chunk: int) -> None:
        """Expose ``chunk``'s layers as this module's forward pass (and its layer files to save/load)."""
        self.active_chunk = chunk
        self.forward_funcs = self.chunk_funcs[chunk]
        ds_seams.set_layer_bounds(self, *self.chunk_bounds(chunk))

    def stage_owner(self, layer_idx: int) -> int:
        # DeepSpeed's asks its stage boundaries; ours are virtual stages (so the tied embedding's group is still
        # rank 0 and rank p - 1).
        for vs in range(len(self.parts) - 1):
            if self.parts[vs] <= layer_idx < self.parts[vs + 1]:
                return vs % self.topology().get_dim("pipe")
        raise RuntimeError(f"layer {layer_idx} is in no virtual stage of {self.parts}")

    def save_state_dict(self, save_dir, checkpoint_engine, exclude_frozen_params=False) -> None:
        for chunk in range(self.num_chunks):
            self.activate_chunk(chunk)
            super().save_state_dict(save_dir, checkpoint_engine, exclude_frozen_params)
        self.activate_chunk(0)

    def load_state_dir(self, load_dir, checkpoint_engine, strict=True) -> None:
        for chunk in range(self.num_chunks):
            self.activate_chunk(chunk)
            super().load_state_dir(load_dir, checkpoint_engine, strict)
        self.activate_chunk(0)

    def chunk_modules(self) -> list[list]:
        """Every chunk's layers, in order."""
        return [list(funcs) for funcs in self.chunk_funcs]
