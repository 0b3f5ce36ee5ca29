"""A checkpoint of ours at ``--load`` written at another TP x PP x DP x EP x ZeRO layout, as a format: resumed in
place, every rank reading only the slices it holds (weights before deepspeed.initialize; fp32 master weights, Adam
moments, the LR and weight-decay position, DeepSpeed's step counters after it), the files checked against the
integrity manifest first. RNG states belong to the old layout and restart from --seed; the log says so once."""

from __future__ import annotations

import time

import torch.distributed as tdist

from megatron.checkpointing.ds_layout.slices import DeepSpeedSource
from megatron.checkpointing.live import verify
from megatron.checkpointing.live.commit import say
from megatron.checkpointing.relayout.fill import Reader, load_optimizer, load_weights, named_parameters
from megatron.checkpointing.relayout.hzero_source import HZeroSource
from megatron.checkpointing.resume_checks import LayoutChange, loads_optimizer
from megatron.checkpointing.state import HZERO_FORMAT, Resume, apply_schedule_lr
from megatron.config import RunConfig
from megatron.core import comm
from megatron.core.parallel_state import ParallelState
from megatron.errors import CheckpointError, MegatronError


class RelayoutFormat:
    """``ckpt_dir``: ``--load/<tag>``; ``meta``: its megatron_meta.json; ``change``: check_resume's verdict."""

    def __init__(self, run: RunConfig, pstate: ParallelState, ckpt_dir: str, meta: dict,
                 change: LayoutChange) -> None:
        self.run, self.pstate, self.ckpt_dir, self.meta, self.change = run, pstate, ckpt_dir, meta, change
        self.reader: Reader | None = None
        self.secs = 0.0
        """Time spent reading (both phases; deepspeed.initialize in between is not counted)."""

    def load_into_model(self, model) -> None:
        """Collective, before deepspeed.initialize: this rank's TP shard of every weight it holds."""
        run, settings = self.run, self.run.checkpoint
        started = time.monotonic()
        verify.verify_collective(self.ckpt_dir, settings.verify, say)  # before a byte of it reaches the model
        verify.validate_files(self.ckpt_dir)
        wanted = {name for name, _ in named_parameters(model, run.model.num_layers)}
        source = (HZeroSource(self.ckpt_dir, self.meta) if self.meta.get("format") == HZERO_FORMAT
                  else DeepSpeedSource(self.ckpt_dir, self.meta, wanted))
        self.reader = Reader(source, self.pstate.tp.rank)
        _agreed(lambda: load_weights(model, self.reader, run.model.num_layers, self.pstate.tp.size))
        self.secs += time.monotonic() - started

    def resume(self, engine) -> Resume:
        """Collective, after deepspeed.initialize: optimizer state, LR position and counters as the flags allow."""
        run, settings, meta, source = self.run, self.run.checkpoint, self.meta, self.reader.source
        started = time.monotonic()
        for line in self.change.notes:
            say(line)
        if getattr(engine, "residual", None) is not None:  # hierarchical ZeRO's int8 network stage
            say("> layout change: the int8 error-feedback residual restarts at zero (it belongs to the old ranks' "
                "gradient chunks)")
        if settings.finetune:
            say(f"> loaded weights from {self.ckpt_dir} at another layout ({self.change.saved} -> "
                f"{self.change.now}; --finetune: iteration, optimizer and RNG start fresh)")
            return Resume(0, 0, self.ckpt_dir)
        load_optim = loads_optimizer(settings, meta)
        why_not = source.moments_why_not() if load_optim else None
        if why_not:
            say(f"> layout change: Adam moments restart ({why_not})")
        what = "weights"
        if load_optim:
            what = _agreed(lambda: load_optimizer(engine, self.reader, run.model.num_layers, self.pstate.tp.size,
                                                  source.adam_step(), moments=why_not is None))
            if run.precision.fp16:
                _restore_loss_scaler(engine, source)
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.legacy_samples_per_step = int(meta["run"]["training"]["global_batch_size"])
            engine.lr_scheduler.load_state_dict(meta.get("lr_scheduler") or {"num_steps": int(meta["iteration"])})
        apply_schedule_lr(engine)
        counters = source.counters()
        engine.global_steps = int(counters["global_steps"] or meta["iteration"])
        engine.global_samples = int(counters["global_samples"] or meta["consumed_samples"])
        engine.skipped_steps = int(counters["skipped_steps"] or 0)
        busiest, secs = comm.reduce_host([self.reader.bytes, self.secs + time.monotonic() - started],
                                         op=tdist.ReduceOp.MAX)
        gbs, saved_train = run.training.global_batch_size, meta["run"]["training"]
        acc_was = saved_train["global_batch_size"] // (saved_train["micro_batch_size"] * self.change.saved.dp)
        batch = "stays" if gbs == saved_train["global_batch_size"] else f"(was {saved_train['global_batch_size']})"
        say(f"> layout changed from {self.change.saved} to {self.change.now}: resumed {meta['tag']} in place ({what};"
            f" {busiest / 2**20:.1f} MiB read on the busiest rank, {secs:.1f} s); global batch {gbs} {batch}, "
            f"gradient accumulation {acc_was} -> {run.training.grad_accumulation_steps(self.pstate.dp.size)}; RNG "
            "states restart from --seed (they belong to the old layout)")
        return Resume(int(meta["iteration"]), int(meta["consumed_samples"]), self.ckpt_dir)


def _agreed(fn):
    """Run ``fn`` on every rank; a checkpoint error on any rank becomes the same one line on all (no rank left
    waiting in a collective)."""
    result, err = None, None
    try:
        result = fn()
    except (MegatronError, OSError, RuntimeError, KeyError) as e:
        err = str(e) if isinstance(e, MegatronError) else f"{type(e).__name__}: {str(e)[:300]}"
    errors = comm.all_gather_object(err)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)
    return result


def _restore_loss_scaler(engine, source: DeepSpeedSource) -> None:
    """fp16: DeepSpeed's dynamic loss scale goes on where it was (the same on every rank)."""
    found = source.loss_scaler()
    opt = engine.optimizer
    if found is not None and found[0] is not None and hasattr(opt, "loss_scaler"):
        opt.loss_scaler, opt.dynamic_loss_scale = found
