"""``ScheduledPipelineEngine``: DeepSpeed's ``PipelineEngine`` running zero-bubble H1 (upstream's two flags) and
Megatron's interleaved 1F1B, in the pattern DeepSpeed uses for its own DualPipeV (deepspeed/runtime/pipe/dualpipev.py):
instructions carry a ``chunk``, the module exposes one chunk at a time, received gradients and losses live per buffer.

Everything else is DeepSpeed's: its forward and backward passes (loss scaling, GAS division, the bf16 optimizer's
gradient bookkeeping), ZeRO-1, the tied-weight all-reduce, the reductions and the optimizer step, the layer-file
checkpoints, ``train_batch`` / ``eval_batch``. What changes:

- B (``BackwardInputPass``) is DeepSpeed's backward pass inside ``WEIGHT_GRAD_STORE.defer``; W (``WeightPass``)
  accumulates the deferred weight gradients through autograd, inside the bracket DeepSpeed puts around a
  non-last-stage backward (bf16 optimizer: clear low-precision grads before, add them to fp32 after; ZeRO's
  post-backward hooks told an engine backward runs). Every weight gradient is in place before ``ReduceGrads``:
  clipping, the NaN/inf check, loss scaling and ZeRO-1's reduction see the whole step.
- Pipeline sends are posted without waiting (``isend``); a receive waits just before its compute. Activations and
  gradients travel on two groups of the pipeline's ranks, so a PP=2 pair carries both kinds apart on RCCL/NCCL too.
  This is our one deliberate difference from upstream's ZB-H1 (whose sends block): with it the exact variant is as
  fast as the default (megatron/perf/schedules.py). The first send of each chunk carries DeepSpeed's shape metadata.
- ``is_first_stage`` / ``is_last_stage`` answer for the active chunk (outside one: the rank's topology), so
  DeepSpeed's loads, loss and GAS scaling follow the virtual stages.
- Zero-bubble H1 stays within 1F1B's peak memory on every stage (megatron/core/pipeline/deferral_cap.py): the
  first step defers no W past the next forward while the engine counts each stage's bytes of one micro-batch
  (memory_count.py); from the second step each stage defers as many as fit (upstream's order when stages are equal).

Activations are sent whole (DeepSpeed's ``pipe_partitioned`` is off for these schedules, megatron/engine.py).
Every DeepSpeed private name used here goes through megatron/ds_seams.py.
"""

from __future__ import annotations

import contextlib
import functools

import deepspeed.comm as dist
import torch
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from megatron import ds_seams
from megatron.core import comm
from megatron.core.pipeline import schedules
from megatron.core.pipeline.deferral_cap import ZB_SCHEDULES, deferral_caps
from megatron.core.pipeline.memory_count import HeldMemory
from megatron.core.tensor_parallel.weight_grad_store import WEIGHT_GRAD_STORE, run_weight_pass


def _as_list(tensors) -> list[torch.Tensor]:
    return [tensors] if torch.is_tensor(tensors) else list(tensors)


class ScheduledPipelineEngine(PipelineEngine):
    """``schedule``: 'zbh1', 'zbh1-exact' or 'interleaved' (the module's ``num_chunks`` chunks per rank).
    ``memory_cap=False``: zero-bubble H1 in upstream's order whatever the stages hold (bench/pipeline_schedules.py,
    whose stand-in layers model time, not memory)."""

    def __init__(self, *args, schedule: str, memory_cap: bool = True, **kwargs) -> None:
        self.schedule_name = schedule
        self.active_chunk = None  # DeepSpeed's __init__ asks is_last_stage() in its topological sense
        super().__init__(*args, **kwargs)
        if self.is_pipe_partitioned or self.is_grad_partitioned:
            raise RuntimeError(f"pipeline schedule {schedule}: DeepSpeed's pipe_partitioned / grad_partitioned must "
                               "be off (megatron/engine.py build_ds_config turns them off)")
        if self.dynamic_shape or self.has_attention_mask or self.has_bool_tensors:
            raise RuntimeError(f"pipeline schedule {schedule}: fixed-shape float and int tensors only between stages")
        self.num_chunks = getattr(self.module, "num_chunks", 1)
        if (self.num_chunks > 1) != (schedule == "interleaved"):
            raise RuntimeError(f"pipeline schedule {schedule} with a module of {self.num_chunks} chunks per rank")
        self.pipe_buffers["grads"] = []  # received output gradients, per buffer
        self.pipe_buffers["losses"] = []  # the loss chunk's losses, per buffer
        self.pending_sends: list[tuple[object, torch.Tensor]] = []
        self.meta_sent: set[int] = set()
        self.recv_specs: dict[int, tuple[bool, list]] = {}
        self.act_group = self.grid.get_pipe_parallel_group()
        self.grad_group = None
        for ranks in self.module.topology().get_axis_comm_lists("pipe"):  # every rank creates every group
            group = dist.new_group(ranks=ranks)
            if self.global_rank in ranks:
                self.grad_group = group
        # Zero-bubble H1's memory cap: each stage's (activations, weight-gradient inputs) of one micro-batch, counted
        # in the first step and agreed by every rank after it; the caps per number of micro-batches.
        self.held_memory = HeldMemory(self) if schedule in ZB_SCHEDULES and memory_cap else None
        self.stage_bytes: tuple[list[float], list[float]] | None = None
        self.caps: dict[int, tuple[int, ...]] = {}

    # ------------------------------------------------------------------ chunks
    def is_first_stage(self) -> bool:
        return self.stage_id == 0 and self.active_chunk in (None, 0)

    def is_last_stage(self) -> bool:
        if self.active_chunk is None:
            return self.stage_id == self.num_stages - 1
        return self.stage_id == self.num_stages - 1 and self.active_chunk == self.num_chunks - 1

    @contextlib.contextmanager
    def chunk_context(self, chunk: int):
        self.active_chunk = chunk
        self.module.activate_chunk(chunk)
        try:
            yield
        finally:
            self.active_chunk = None

    def _train_schedule(self):
        return schedules.train_schedule(self.schedule_name, self.micro_batches, self.num_stages, self.stage_id,
                                        self.num_chunks, cap=self.deferral_cap())

    def deferral_cap(self) -> int | None:
        """This stage's zero-bubble memory cap for this step (None: not zero-bubble, or no cap; 0 until the stages are
        counted: no W waits past the next forward, 1F1B's memory)."""
        if self.held_memory is None:
            return None
        if self.stage_bytes is None:
            return 0
        if self.micro_batches not in self.caps:
            self.caps[self.micro_batches] = deferral_caps(self.schedule_name, self.num_stages, self.micro_batches,
                                                          *self.stage_bytes)
        return self.caps[self.micro_batches][self.stage_id]

    def _count_stages(self) -> None:
        """After the first step: every stage's bytes of one micro-batch, the largest over its ranks, on every rank
        (so that the ranks of a stage run the same order)."""
        p, mine = self.num_stages, self.held_memory
        values = [0.0] * (2 * p)
        values[self.stage_id], values[p + self.stage_id] = float(mine.forward_bytes), float(mine.deferred_bytes)
        values = comm.reduce_host(values, op=torch.distributed.ReduceOp.MAX)
        self.stage_bytes = (values[:p], values[p:])
        mine.counting = mine.every_step

    def _inference_schedule(self, micro_batches):
        return schedules.inference_schedule(micro_batches, self.num_stages, self.stage_id, self.num_chunks)

    def train_batch(self, data_iter=None):
        WEIGHT_GRAD_STORE.clear()
        try:
            loss = super().train_batch(data_iter)
        finally:  # an exception leaves nothing deferred for the next step
            WEIGHT_GRAD_STORE.clear()
        if self.held_memory is not None and self.stage_bytes is None:
            self._count_stages()
        return loss

    def reset_activation_shape(self) -> None:
        super().reset_activation_shape()
        self.meta_sent, self.recv_specs = set(), {}

    # ------------------------------------------------------------------ compute
    def _exec_load_micro_batch(self, buffer_id, chunk=0):
        with self.chunk_context(chunk):
            super()._exec_load_micro_batch(buffer_id)

    def _exec_forward_pass(self, buffer_id, chunk=0):
        with self.chunk_context(chunk):
            super()._exec_forward_pass(buffer_id)
            last = self.is_last_stage()
        if not torch.is_grad_enabled():  # evaluation: no backward frees them
            self.pipe_buffers["inputs"][buffer_id] = None
            self.pipe_buffers["labels"][buffer_id] = None
            if last:
                self.pipe_buffers["outputs"][buffer_id] = None
        elif last:
            self.pipe_buffers["losses"][buffer_id] = self.loss

    def _exec_backward_pass(self, buffer_id, chunk=0, defer=False):
        """DeepSpeed's backward pass of ``chunk``'s buffer; ``defer`` (B): with the deferrable weight gradients left
        in the store for this buffer's W."""
        buffers = self.pipe_buffers
        deferring = WEIGHT_GRAD_STORE.defer(key=buffer_id) if defer else contextlib.nullcontext()
        with self.chunk_context(chunk), deferring:
            if self.is_last_stage():
                self.loss = buffers["losses"][buffer_id]
            else:
                self.grad_layer = buffers["grads"][buffer_id]
            super()._exec_backward_pass(buffer_id)
            first = self.is_first_stage()
        self.grad_layer = None
        for key in ("outputs", "output_tensors", "grads", "losses", "labels"):
            buffers[key][buffer_id] = None
        if first:  # no SendGrad frees them
            buffers["inputs"][buffer_id] = None

    def _exec_weight_pass(self, buffer_id, chunk=0):
        items = WEIGHT_GRAD_STORE.pop(buffer_id)
        bf16 = self.using_bf16_optimizer
        if bf16:  # as DeepSpeed around a non-last-stage backward: W's low-precision grads alone go to fp32
            self.optimizer.clear_lp_grads()
        with ds_seams.engine_backward(self):
            run_weight_pass(items)
        if bf16 and not ds_seams.engine_ds_config(self).bfloat16_config.immediate_grad_update:
            self.optimizer.update_hp_grads(clear_lp_grads=False)

    # ------------------------------------------------------------------ p2p
    def _peer(self, stage: int) -> int:
        return self.grid.stage_to_global(stage_id=stage % self.num_stages)

    def _post_sends(self, tensors: list[torch.Tensor], stage: int, group) -> None:
        self.pending_sends = [(w, t) for w, t in self.pending_sends if not w.is_completed()]
        for t in tensors:
            t = t.contiguous()
            self.pending_sends.append((comm.isend(t, self._peer(stage), group), t))

    def _exec_drain_sends(self):
        for work, _ in self.pending_sends:
            work.wait()
        self.pending_sends = []
        if torch.is_grad_enabled() and WEIGHT_GRAD_STORE.pending():
            raise RuntimeError(f"pipeline schedule {self.schedule_name}: {WEIGHT_GRAD_STORE.pending()} weight passes "
                               "never ran")

    def _exec_send_activations(self, buffer_id, chunk=0):
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if chunk not in self.meta_sent:
            self.meta_sent.add(chunk)
            ds_seams.send_pipe_meta(self, outputs, (self.stage_id + 1) % self.num_stages)
        self._post_sends(_as_list(outputs), self.stage_id + 1, self.act_group)
        if not torch.is_grad_enabled():
            self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_recv_activations(self, buffer_id, chunk=0):
        src = (self.stage_id - 1) % self.num_stages
        if chunk not in self.recv_specs:
            self.recv_specs[chunk] = ds_seams.recv_pipe_meta(self, src)
        is_tensor, specs = self.recv_specs[chunk]
        recvd = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs]
        for t in recvd:
            comm.recv(t, self._peer(src), self.act_group)
            t.requires_grad_(t.is_floating_point())
        self.pipe_buffers["inputs"][buffer_id] = recvd[0] if is_tensor else tuple(recvd)

    def _exec_send_grads(self, buffer_id, chunk=0):
        inputs = self.pipe_buffers["inputs"][buffer_id]
        grads = [t.grad for t in _as_list(inputs) if t.is_floating_point()]
        if any(g is None for g in grads):
            raise RuntimeError(f"pipeline schedule {self.schedule_name}: an input of buffer {buffer_id} got no grad")
        self._post_sends(grads, self.stage_id - 1, self.grad_group)
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id, chunk=0):
        outputs = self.pipe_buffers["outputs"][buffer_id]
        grads = [torch.empty_like(t) for t in _as_list(outputs) if t.is_floating_point()]
        for g in grads:
            comm.recv(g, self._peer(self.stage_id + 1), self.grad_group)
        self.pipe_buffers["grads"][buffer_id] = grads[0] if torch.is_tensor(outputs) else grads

    _INSTRUCTION_MAP = ds_seams.pipeline_instruction_map({
        ds_schedule.LoadMicroBatch: _exec_load_micro_batch,
        ds_schedule.ForwardPass: _exec_forward_pass,
        ds_schedule.BackwardPass: _exec_backward_pass,
        ds_schedule.SendActivation: _exec_send_activations,
        ds_schedule.RecvActivation: _exec_recv_activations,
        ds_schedule.SendGrad: _exec_send_grads,
        ds_schedule.RecvGrad: _exec_recv_grads,
        schedules.BackwardInputPass: functools.partial(_exec_backward_pass, defer=True),
        schedules.WeightPass: _exec_weight_pass,
        schedules.DrainSends: _exec_drain_sends,
    })
