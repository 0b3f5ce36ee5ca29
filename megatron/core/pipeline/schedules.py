"""The compute orders of megatron/core/pipeline/orders.py as DeepSpeed instruction lists (``PipeSchedule``), with the
two instructions DeepSpeed lacks: a backward of input gradients only (B) and the weight pass (W) of zero-bubble H1.

Each compute expands to its communication: a forward to ``[RecvActivation] [LoadMicroBatch] ForwardPass
[SendActivation]``, a backward to ``[RecvGrad] BackwardPass|BackwardInputPass [SendGrad]`` (no receive into the first
virtual stage, no send out of the last; loads on the first, for tokens, and the last, for labels). Sends are posted
without waiting (megatron/core/pipeline/engine.py); a receive waits right before the compute that needs it; every
send is complete before the step's reductions (``DrainSends``). Buffer ``chunk * m + mb`` holds one chunk's
micro-batch, so no slot is reused while a send may still read it.
"""

from __future__ import annotations

from deepspeed.runtime.pipe.schedule import (
    BackwardPass,
    BufferOpInstruction,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)

from megatron.core.pipeline.orders import B, BW, F, W, Op, forward_only_order, train_order


class BackwardInputPass(BufferOpInstruction):
    """B: the backward pass of one buffer with the deferrable weight gradients left in the weight-gradient store
    (upstream's BackwardOnlyPass)."""


class WeightPass(BufferOpInstruction):
    """W: the weight gradients that buffer's B left behind (upstream's WeightPass, which takes no buffer: the buffer
    here names the item the store must hand back, a check on the schedule)."""


class DrainSends(PipeInstruction):
    """Wait for every pipeline send this rank posted (before the step's reductions, and at the end of evaluation)."""


class OrderedSchedule(PipeSchedule):
    """The instructions of one rank's compute ``order`` (``train``: followed by the step's reductions)."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, order: list[Op], chunks: int = 1,
                 train: bool = True) -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.order, self.chunks, self.train = order, chunks, train

    def num_pipe_buffers(self) -> int:
        return self.chunks * self.micro_batches

    def steps(self):
        for op in self.order:
            yield self.expand(op)
        yield [DrainSends(), ReduceTiedGrads(), ReduceGrads(), OptimizerStep()] if self.train else [DrainSends()]

    def expand(self, op: Op) -> list[PipeInstruction]:
        vs = op.chunk * self.stages + self.stage_id
        first, last = vs == 0, vs == self.stages * self.chunks - 1
        buf, kw = op.chunk * self.micro_batches + op.mb, {"chunk": op.chunk}
        if op.kind == F:
            cmds = [] if first else [RecvActivation(buf, **kw)]
            cmds += [LoadMicroBatch(buf, **kw)] if first or last else []
            return cmds + [ForwardPass(buf, **kw)] + ([] if last else [SendActivation(buf, **kw)])
        if op.kind in (B, BW):
            cmds = [] if last else [RecvGrad(buf, **kw)]
            cmds.append(BackwardInputPass(buf, **kw) if op.kind == B else BackwardPass(buf, **kw))
            return cmds + ([] if first else [SendGrad(buf, **kw)])
        assert op.kind == W
        return [WeightPass(buf, **kw)]


def train_schedule(name: str, micro_batches: int, stages: int, stage_id: int, chunks: int = 1,
                   cap: int | None = None) -> OrderedSchedule:
    """``name``: 'zbh1', 'zbh1-exact' or 'interleaved' (megatron/core/pipeline/orders.py SCHEDULES); ``cap``:
    zero-bubble H1's memory cap on this stage (orders.py ``zbh1_order``)."""
    order = train_order(name, stages, micro_batches, stage_id, chunks, cap=cap)
    return OrderedSchedule(micro_batches, stages, stage_id, order, chunks)


def inference_schedule(micro_batches: int, stages: int, stage_id: int, chunks: int = 1) -> OrderedSchedule:
    return OrderedSchedule(micro_batches, stages, stage_id, forward_only_order(stages, micro_batches, chunks), chunks,
                           train=False)
