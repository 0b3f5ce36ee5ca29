"""Our ``--save`` directory: the crash-safe save and the exact resume of the checkpoints training writes, around the
files of a format (ds_layout/: DeepSpeed's own layout; hzero/: hierarchical ZeRO's per-rank shards).

Layout of ``--save DIR``::

    DIR/latest                       one line: the tag of the newest complete checkpoint
    DIR/global_step200/              the format's files + megatron_meta.json + integrity.json
    DIR/global_step300.tmp-<id>/     a save in progress (or one a crash interrupted; never loaded)

A save writes every file under the temporary tag (each file fsynced), waits for every rank, then rank 0
renames the directory to its final tag and only then moves ``latest`` (temp file + rename). A crash at
any moment leaves ``latest`` naming a complete checkpoint.
"""

from __future__ import annotations

import os
import time

import torch

from megatron import ds_seams
from megatron.checkpointing.live import integrity, space, verify
from megatron.checkpointing.live.async_save import AsyncSaver, PendingSave
from megatron.checkpointing.live.commit import Failure, check_saved, commit, rank0, say
from megatron.checkpointing.live.markers import read_meta
from megatron.checkpointing.live.safe_io import SafeCheckpointEngine
from megatron.checkpointing.resume_checks import check_resume, loads_optimizer
from megatron.checkpointing.state import (
    Resume,
    apply_schedule_lr,
    partition_table,
    plain_args,
    plain_run,
    rng_for_rank,
)
from megatron.config import RunConfig
from megatron.core import comm
from megatron.core.parallel_state import ParallelState
from megatron.errors import CheckpointError


def _agreed_id() -> str:
    """One id for this save on every rank (DeepSpeed checks that all ranks use the same tag)."""
    mine = int(time.time() * 1000) % 10**12 * 1000 + os.getpid() % 1000 if rank0() else 0
    return f"{comm.reduce_host([mine], dtype=torch.int64)[0]:x}"


class TaggedFormat:
    """A format training writes: its files go into ``global_stepN/`` of our --save directory. A subclass names its
    ``FORMAT`` and fills three hooks (``checkpoint_engine``, ``write``, ``restore``); this class runs the save and the
    resume around them. ``ckpt_dir``/``tag``: the checkpoint of ours ``--load`` names (None: there is none)."""

    FORMAT = ""
    """megatron_meta.json's ``format``."""

    def __init__(self, run: RunConfig, pstate: ParallelState, ckpt_dir: str | None = None,
                 tag: str | None = None) -> None:
        self.run, self.pstate, self.ckpt_dir, self.tag = run, pstate, ckpt_dir, tag

    # ------------------------------------------------------------------ the format's hooks
    def checkpoint_engine(self, engine) -> SafeCheckpointEngine:
        """The engine's own checkpoint engine, made safe (hashing, fsync, weights_only)."""
        raise NotImplementedError

    def write(self, engine, save_dir: str, tmp_tag: str, meta: dict) -> Failure | None:
        """Collective: write this rank's files into ``save_dir/tmp_tag`` (through ``engine.checkpoint_engine``) and
        add what the format records to ``meta``; an OSError raised outside the checkpoint engine is returned."""
        raise NotImplementedError

    def restore(self, engine, ckpt_dir: str, meta: dict, load_optim: bool) -> tuple[str | None, dict]:
        """Collective: load the files of ``ckpt_dir`` into ``engine``; (the path loaded, None on failure; the saved
        client state: ``iteration``, ``consumed_samples`` and the RNG, ``rng_state`` for this rank or ``rng_states``
        over DP)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ load
    def load_into_model(self, model) -> None:
        """Nothing before the engine: a checkpoint of ours goes into the engine (``resume``)."""

    def resume(self, engine) -> Resume:
        """Collective. Restores weights, optimizer, LR schedule, RNG states, iteration and consumed samples
        (as the flags allow) from the checkpoint of ours at ``--load``."""
        run, pstate, settings, ckpt_dir = self.run, self.pstate, self.run.checkpoint, self.ckpt_dir
        meta = read_meta(ckpt_dir)
        load_optim = loads_optimizer(settings, meta)
        check_resume(meta, run, load_optim, ckpt_dir)
        verify.verify_collective(ckpt_dir, settings.verify, say)  # sizes and checksums, shared over the ranks
        verify.validate_files(ckpt_dir)
        if getattr(engine, "lr_scheduler", None) is not None:  # an older, iteration-counting schedule state: per step
            engine.lr_scheduler.legacy_samples_per_step = int(meta["run"]["training"]["global_batch_size"])
        path, client = self.restore(engine, ckpt_dir, meta, load_optim)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load {ckpt_dir}; check that its files are complete")
        apply_schedule_lr(engine)
        if settings.finetune:
            say(f"> loaded weights from {ckpt_dir} (--finetune: iteration, optimizer and RNG start fresh)")
            return Resume(0, 0, ckpt_dir)
        rng = None
        if not settings.no_load_rng and "rng_state" in client:  # hierarchical ZeRO: this rank's own
            rng = client["rng_state"]
        elif not settings.no_load_rng:
            rng = rng_for_rank(client["rng_states"], pstate.dp.rank, pstate.dp.size)
            if rng is None:
                say(f"> WARNING: {ckpt_dir} was saved with {len(client['rng_states'])} data-parallel ranks, now "
                    f"{pstate.dp.size}: RNG states not restored (dropout masks will differ from a straight run)")
        say(f"> loaded {ckpt_dir}: iteration {client['iteration']}, consumed samples {client['consumed_samples']}"
            f"{'' if load_optim else ' (optimizer not loaded)'}")
        return Resume(int(client["iteration"]), int(client["consumed_samples"]), ckpt_dir, rng=rng)

    # ------------------------------------------------------------------ save
    def save(self, engine, iteration: int, consumed_samples: int, saver: AsyncSaver | None = None) -> str:
        """Collective: every rank calls it (to ``run.checkpoint.save``). Returns the final checkpoint directory.

        With ``saver`` (--async-save) the files are copied to host memory and written in the background; the commit
        follows later (async_save.py). The save in flight before this one is finished and committed first."""
        if saver is not None:
            saver.finish(f"before the save of iteration {iteration} (one save in flight at most)")
        run, settings = self.run, self.run.checkpoint
        save_dir = settings.save
        tag = f"global_step{iteration}"
        tmp_tag = f"{tag}.tmp-{_agreed_id()}"
        # RNG states differ per DP rank but DeepSpeed writes client_state once per model-parallel rank:
        # gather them over DP so every model file carries the whole list (Megatron does the same).
        tables = comm.all_gather_object(partition_table(engine.module, run.model.num_layers))
        meta = {"iteration": iteration, "consumed_samples": consumed_samples, "args": plain_args(run.flags),
                "run": plain_run(run), "has_optimizer": not settings.no_save_optim, "tag": tag,
                "lr_num_steps": iteration,  # kept for older readers; the position is "lr_scheduler" (in samples)
                "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
                "partition_table": {k: v for t in tables for k, v in t.items()},
                "format": self.FORMAT}
        free = space.free_bytes(save_dir) if rank0() else None  # for the one line of a failed save
        own = self.checkpoint_engine(engine)
        # Every file goes through engine.checkpoint_engine.save(state, path): under --async-save a recorder that
        # copies the state to host memory; the engine-specific gathering (ZeRO partitions, pipeline layers) stays
        # the engine's.
        writer = saver.recorder(own) if saver is not None else own
        writer.failure = None
        ds_seams.swap_checkpoint_engine(engine, writer)
        try:
            failure = self.write(engine, save_dir, tmp_tag, meta)
        finally:
            ds_seams.swap_checkpoint_engine(engine, own)
        failure = failure or writer.failure
        tmp = os.path.join(save_dir, tmp_tag)
        # Every rank's files are on disk, or copied (or failed): all agree before rank 0 commits or the writers start.
        check_saved(failure, save_dir, tmp, free, run, settings)
        if saver is not None:
            saver.launch(PendingSave(tag, tmp_tag, iteration, meta, free), writer)
            return os.path.join(save_dir, tag)
        files = {k: v for part in comm.all_gather_object(integrity.recorded(tmp)) for k, v in part.items()}
        failure = commit(save_dir, tmp_tag, tag, iteration, meta, files, settings.keep_last) if rank0() else None
        check_saved(failure, save_dir, tmp, free, run, settings)  # nobody proceeds before the commit
        return os.path.join(save_dir, tag)
