"""DeepSpeed's own layout as a format training writes: its engines (ZeRO-0..3, pipeline, hpZ) save and load their
files through ``engine.save_checkpoint`` / ``load_checkpoint``, with our safe checkpoint engine underneath."""

from __future__ import annotations

import os

from megatron import ds_seams
from megatron.checkpointing.ds_layout.read import OPTIMIZER_NAMES
from megatron.checkpointing.live import safe_io
from megatron.checkpointing.live.commit import Failure
from megatron.checkpointing.live.directory import TaggedFormat
from megatron.checkpointing.live.safe_io import SafeCheckpointEngine
from megatron.checkpointing.resume_checks import chunks_changed
from megatron.checkpointing.state import DEEPSPEED_FORMAT, rng_state
from megatron.core import comm
from megatron.model.param_names import canonical_name, expert_offsets, globalize


class DeepSpeedFormat(TaggedFormat):
    FORMAT = DEEPSPEED_FORMAT

    def checkpoint_engine(self, engine) -> SafeCheckpointEngine:
        return safe_io.install(engine)

    def write(self, engine, save_dir: str, tmp_tag: str, meta: dict) -> Failure | None:
        settings = self.run.checkpoint
        ckpt_engine = safe_io.install(engine)
        # RNG states differ per DP rank but DeepSpeed writes client_state once per model-parallel rank:
        # gather them over DP so every model file carries the whole list (Megatron does the same).
        rngs = comm.all_gather_object(rng_state(), group=self.pstate.dp.group)
        client_state = {**meta, "rng_states": rngs, OPTIMIZER_NAMES: optimizer_names(engine, self.run.model.num_layers)}
        try:
            ckpt_engine.drop_optimizer = settings.no_save_optim
            with ds_seams.zero_files_skipped(engine, settings.no_save_optim):
                engine.save_checkpoint(save_dir, tag=tmp_tag, client_state=client_state, save_latest=False)
        except OSError as e:  # written outside the checkpoint engine (DeepSpeed's directories, scripts)
            return (e.filename or os.path.join(save_dir, tmp_tag), e)
        finally:
            ckpt_engine.drop_optimizer = False
        return None

    moments_moved: tuple[str, dict] | None = None
    """(checkpoint directory, its metadata) when its optimizer files hold other layers per rank than this run's
    (another chunking): the Checkpointer then carries the Adam moments by name."""

    def restore(self, engine, ckpt_dir: str, meta: dict, load_optim: bool) -> tuple[str | None, dict]:
        settings = self.run.checkpoint
        safe_io.install(engine)
        if load_optim and chunks_changed(meta, self.run):
            self.moments_moved, load_optim = (ckpt_dir, meta), False
        return engine.load_checkpoint(settings.load, tag=self.tag, load_optimizer_states=load_optim,
                                      load_lr_scheduler_states=not settings.finetune,
                                      load_module_only=settings.finetune)


def optimizer_names(engine, num_layers: int) -> list[str | None] | None:
    """The full-state name of each parameter of a torch optimizer (ZeRO-0), in its order (None: no stored weight),
    so that its moments can go to another placement of the layers (another chunking, read.zero0_moments); None
    when the optimizer holds flat partitions (ZeRO-1/2 map theirs in their own files)."""
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    params = [p for g in getattr(base, "param_groups", []) for p in g["params"]]
    offsets = expert_offsets(engine.module)
    names = {id(p): globalize(n, c, offsets) if (c := canonical_name(n, num_layers)) is not None else None
             for n, p in engine.module.named_parameters()}
    return [names[id(p)] for p in params] if params and all(id(p) in names for p in params) else None
