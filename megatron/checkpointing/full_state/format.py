"""A full-state directory at ``--load`` as a format: the weights go into the model before deepspeed.initialize (each
rank its TP/EP share, so any layout loads it), the LR position and the Adam moments into the engine after it.
Training never writes this format; tools/reshard_checkpoint.py and the HF importer do."""

from __future__ import annotations

from megatron.checkpointing.full_state.files import read_full_moments, read_full_state
from megatron.checkpointing.full_state.merge import merge_moments
from megatron.checkpointing.full_state.shard import load_into_model, load_moments
from megatron.checkpointing.live import verify
from megatron.checkpointing.live.commit import say
from megatron.checkpointing.resume_checks import check_experts, check_model_shape
from megatron.checkpointing.state import Resume, apply_schedule_lr
from megatron.config import RunConfig
from megatron.core.parallel_state import ParallelState
from megatron.errors import CheckpointError


class FullStateFormat:
    """``path``: the full-state directory ``--load`` names."""

    def __init__(self, run: RunConfig, pstate: ParallelState, path: str) -> None:
        self.run, self.pstate, self.path = run, pstate, path
        self.loaded: Resume | None = None
        """What ``load_into_model`` read besides the weights, for ``resume``."""

    def load_into_model(self, model) -> None:
        """Before deepspeed.initialize: copy this rank's shards into ``model``."""
        run, pstate, settings = self.run, self.pstate, self.run.checkpoint
        verify.verify_collective(self.path, settings.verify, say)  # before a byte of it reaches the model
        full, meta = read_full_state(self.path)
        check_model_shape(meta["model"], run, self.path)
        check_experts(meta["model"].get("moe") or {}, run, self.path)  # experts merged: any EP
        load_into_model(model, full, run.model.num_layers, pstate.tp.size, pstate.tp.rank, self.path)
        if settings.finetune:
            self.loaded = Resume(0, 0, self.path)
            return
        self.loaded = Resume(int(meta.get("iteration", 0)), int(meta.get("consumed_samples", 0)), self.path,
                             int(meta.get("lr_num_steps", meta.get("iteration", 0))), meta.get("lr_scheduler"))

    def resume(self, engine) -> Resume:
        """Collective. The weights are in already: the LR position, the Adam moments (as the flags allow)."""
        full, settings, pstate = self.loaded, self.run.checkpoint, self.pstate
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(full.lr_state or {"num_steps": full.lr_num_steps})
            apply_schedule_lr(engine)
        optim = "optimizer starts fresh; RNG restored" if full.rng else "optimizer and RNG start fresh"
        got = None if settings.finetune or settings.no_load_optim else full.moments or read_full_moments(full.path)
        if got is not None:  # a resharded checkpoint's Adam moments (tools/reshard_checkpoint.py)
            optim = load_moments(engine, got[0], got[1], pstate.tp.size, pstate.tp.rank, self.run.model.num_layers,
                                 full.path) + ("; RNG restored" if full.rng else "; RNG starts fresh")
        say(f"> loaded full-state weights from {full.path}: iteration {full.iteration}, consumed samples "
            f"{full.consumed_samples} ({optim})")
        return full


def carry_moments(engine, run: RunConfig, pstate: ParallelState, ckpt_dir: str, meta: dict) -> None:
    """Collective. The Adam moments of a checkpoint of ours whose ranks held other layers (another chunking) into
    ``engine``, by parameter name through the full moments (the padded vocabulary rows kept: they have moments)."""
    moments, step, why = merge_moments(ckpt_dir, meta, unpad=False)  # the same TP size: the same padding
    if moments is None:
        raise CheckpointError(f"--load {ckpt_dir}: its Adam moments cannot follow the layers to this run's chunks "
                              f"per pipeline rank ({why}). Pass --no-load-optim (the weights carry over, the "
                              "moments restart)")
    done = load_moments(engine, moments, step, pstate.tp.size, pstate.tp.rank, run.model.num_layers, ckpt_dir)
    say(f"> {done} by name from {ckpt_dir} (saved with other layers per pipeline rank)")
