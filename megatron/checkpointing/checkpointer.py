"""The one save/load interface of a run: ``open_checkpoint`` picks, once, the format of what sits at ``--load``
(locate.classify_load) and the format this run's engine writes; pretrain() then calls the Checkpointer at three
points (torchtitan's CheckpointManager is the model)::

    ckpt = open_checkpoint(run, pstate, ds_config)
    ckpt.load_into_model(model)      before deepspeed.initialize: a full state's or upstream checkpoint's weights
    resume = ckpt.resume(engine)     weights, optimizer, LR position, RNG, iteration, consumed samples
    ckpt.save(engine, iteration, consumed_samples, saver)

Every format is a small object with the same protocol (``CheckpointFormat``; the ones training writes add ``save``):

    ds_layout.format.DeepSpeedFormat          DeepSpeed's own layout (ZeRO-0..3, pipeline, hpZ)   load, save
    hzero.format.HierarchicalZeroFormat       hierarchical ZeRO's per-rank shards                  load, save
    full_state.format.FullStateFormat         the layout-free full state (any layout)             load
    relayout.format.RelayoutFormat            ours, written at another TP/PP/DP/EP/ZeRO layout     load
    upstream.resume.UpstreamFormat            upstream Megatron(-DeepSpeed), DeepSpeed universal   load
"""

from __future__ import annotations

from typing import Protocol

from megatron.checkpointing.ds_layout.format import DeepSpeedFormat
from megatron.checkpointing.full_state.format import FullStateFormat, carry_moments
from megatron.checkpointing.hzero.format import HierarchicalZeroFormat
from megatron.checkpointing.live.async_save import AsyncSaver
from megatron.checkpointing.live.commit import name_leftovers, say
from megatron.checkpointing.live.markers import LATEST, read_meta
from megatron.checkpointing.locate import classify_load
from megatron.checkpointing.relayout.format import RelayoutFormat
from megatron.checkpointing.resume_checks import check_resume, loads_optimizer
from megatron.checkpointing.state import Resume
from megatron.checkpointing.support import engine_kind
from megatron.checkpointing.upstream.resume import UpstreamFormat
from megatron.config import CheckpointSettings, RunConfig
from megatron.core.parallel_state import ParallelState


class CheckpointFormat(Protocol):
    """One kind of checkpoint at ``--load``."""

    def load_into_model(self, model) -> None:
        """Before deepspeed.initialize (collective): weights that go into the model before ZeRO partitions it."""

    def resume(self, engine) -> Resume:
        """After deepspeed.initialize (collective): what goes into the engine; what the loop resumes from."""


class TrainingFormat(CheckpointFormat, Protocol):
    """A format training writes (to ``--save``)."""

    def save(self, engine, iteration: int, consumed_samples: int, saver: AsyncSaver | None = None) -> str:
        """Collective: a crash-safe checkpoint of ``engine`` at ``iteration``; returns its directory."""


class FreshStart:
    """Nothing to load: no ``--load``, or a directory without a checkpoint (``empty``: its path)."""

    def __init__(self, empty: str | None = None) -> None:
        self.empty = empty

    def load_into_model(self, model) -> None:
        """Nothing: the model keeps its initialisation."""

    def resume(self, engine) -> Resume:
        if self.empty:  # preflight has warned (or refused, with --exit-on-missing-checkpoint)
            say(f"> no checkpoint in {self.empty} (no '{LATEST}' file): starting from scratch")
        return Resume()


class Checkpointer:
    """``source``: the format of what ``--load`` holds; ``target``: the format this run's engine writes (the same
    object when ``--load`` holds a checkpoint of ours)."""

    def __init__(self, settings: CheckpointSettings, source: CheckpointFormat, target: TrainingFormat) -> None:
        self.settings, self.source, self.target = settings, source, target

    def load_into_model(self, model) -> None:
        """Collective, before deepspeed.initialize: a full state's or upstream checkpoint's weights into ``model``
        (each rank its shard, at any layout); nothing for the other formats."""
        self.source.load_into_model(model)

    def resume(self, engine) -> Resume:
        """Collective. Restores weights, optimizer, LR schedule, RNG states, iteration and consumed samples (as the
        flags allow). Without a checkpoint in ``--load`` the run starts from scratch."""
        name_leftovers(self.settings)
        resume = self.source.resume(engine)
        if getattr(self.source, "moments_moved", None):  # another chunking: the moments go by name
            carry_moments(engine, self.source.run, self.source.pstate, *self.source.moments_moved)
        return resume

    def save(self, engine, iteration: int, consumed_samples: int, saver: AsyncSaver | None = None) -> str:
        """Collective: every rank calls it (to ``--save``). Returns the final checkpoint directory. With ``saver``
        (--async-save) the files are written in the background and committed later."""
        return self.target.save(engine, iteration, consumed_samples, saver)


def open_checkpoint(run: RunConfig, pstate: ParallelState, ds_config: dict) -> Checkpointer:
    """The Checkpointer of this run: what ``--load`` holds, classified once (files and markers only), and the format
    of the engine ``ds_config`` builds (hierarchical ZeRO's shards, else DeepSpeed's layout). A checkpoint of ours
    is read by the engine's own format, or, written at another layout or by the other engine (DeepSpeed's,
    hierarchical ZeRO's), by relayout/ in place (resume_checks.check_resume decides)."""
    target = classify_load(run.checkpoint)
    writes = HierarchicalZeroFormat if engine_kind(run, ds_config) == "hierarchical" else DeepSpeedFormat
    if target.kind == "ours":
        meta = read_meta(target.path)
        change = check_resume(meta, run, loads_optimizer(run.checkpoint, meta), target.path)
        if change is not None:  # written at another layout: read in place, slice by slice
            return Checkpointer(run.checkpoint, RelayoutFormat(run, pstate, target.path, meta, change),
                                writes(run, pstate))
        ours = writes(run, pstate, target.path, target.tag)
        return Checkpointer(run.checkpoint, ours, ours)
    if target.kind == "full_state":
        source = FullStateFormat(run, pstate, target.path)
    elif target.kind == "upstream":
        source = UpstreamFormat(run, pstate, target.found)
    else:
        source = FreshStart(run.checkpoint.load if target.kind == "empty" else None)
    return Checkpointer(run.checkpoint, source, writes(run, pstate))
