"""Crash-safe save and exact resume through DeepSpeed's ``engine.save_checkpoint`` / ``load_checkpoint``.

Layout of ``--save DIR`` (DeepSpeed's, so its tools read it)::

    DIR/latest                       one line: the tag of the newest complete checkpoint
    DIR/global_step200/              DeepSpeed's model / ZeRO / pipeline-layer files + megatron_meta.json
    DIR/global_step300.tmp-<id>/     a save in progress (or one a crash interrupted; never loaded)

A save writes every file under the temporary tag (each file fsynced), waits for every rank, then rank 0
renames the directory to its final tag and only then moves ``latest`` (temp file + rename). A crash at
any moment leaves ``latest`` naming a complete checkpoint.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as tdist

from megatron.checkpointing import integrity, safe_io, space, verify
from megatron.checkpointing import hierarchical_zero as hzero_ckpt
from megatron.checkpointing.async_save import AsyncSaver, PendingSave
from megatron.checkpointing.commit import check_saved, commit, latest_or_none, leftovers, rank0
from megatron.checkpointing.full_state import (
    load_into_model,
    partition_table,
    read_full_moments,
    read_full_state,
)
from megatron.checkpointing.locate import LATEST, classify_load, read_meta
from megatron.checkpointing.moments import load_moments
from megatron.checkpointing.state import (
    Resume,
    check_experts,
    check_model_shape,
    check_resume,
    loads_optimizer,
    plain_args,
    plain_run,
    rng_for_rank,
    rng_state,
)
from megatron.checkpointing.upstream import load_upstream
from megatron.config import CheckpointSettings, RunConfig
from megatron.core import comm, hierarchical_zero
from megatron.core.parallel_state import ParallelState
from megatron.errors import CheckpointError, ConfigError

def _agreed_id() -> str:
    """One id for this save on every rank (DeepSpeed checks that all ranks use the same tag)."""
    mine = int(time.time() * 1000) % 10**12 * 1000 + os.getpid() % 1000 if rank0() else 0
    return f"{comm.reduce_host([mine], dtype=torch.int64)[0]:x}"


def save_checkpoint(engine, iteration: int, consumed_samples: int, run: RunConfig, pstate: ParallelState,
                    saver: AsyncSaver | None = None) -> str:
    """Collective: every rank calls it (to ``run.checkpoint.save``). Returns the final checkpoint directory.

    With ``saver`` (--async-save) the files are copied to host memory and written in the background; the commit
    follows later (async_save.py). The save in flight before this one is finished and committed first."""
    if saver is not None:
        saver.finish(f"before the save of iteration {iteration} (one save in flight at most)")
    settings = run.checkpoint
    save_dir = settings.save
    tag = f"global_step{iteration}"
    tmp_tag = f"{tag}.tmp-{_agreed_id()}"
    if settings.no_save_optim and run.parallel.zero_stage == 3 and not hzero_ckpt.is_engine(engine):
        raise ConfigError("--no-save-optim with --zero-stage 3: ZeRO-3 keeps the weights only in the optimizer "
                          "partitions; save the optimizer or use ZeRO-1/2")
    # RNG states differ per DP rank but DeepSpeed writes client_state once per model-parallel rank:
    # gather them over DP so every model file carries the whole list (Megatron does the same).
    tables = comm.all_gather_object(partition_table(engine.module, run.model.num_layers))
    meta = {"iteration": iteration, "consumed_samples": consumed_samples, "args": plain_args(run.flags),
            "run": plain_run(run), "has_optimizer": not settings.no_save_optim, "tag": tag,
            "lr_num_steps": iteration,  # kept for older readers; the position is "lr_scheduler" (in samples)
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "partition_table": {k: v for t in tables for k, v in t.items()},
            "format": "megatron-frontier/deepspeed-v1"}
    free = space.free_bytes(save_dir) if rank0() else None  # for the one line of a failed save
    failure = None
    hzero = hzero_ckpt.is_engine(engine)
    own = hzero_ckpt.checkpoint_engine(engine) if hzero else safe_io.install(engine)
    # Every file goes through engine.checkpoint_engine.save(state, path): under --async-save a recorder that copies
    # the state to host memory; the engine-specific gathering (ZeRO partitions, pipeline layers) stays the engine's.
    writer = saver.recorder(own) if saver is not None else own
    writer.failure = None
    engine.checkpoint_engine = writer
    try:
        if hzero:  # hierarchical ZeRO: every rank writes its own file, RNG state included
            meta.update(format=hzero_ckpt.FORMAT, hierarchy=hzero_ckpt.layout(engine, _ranks_per_node(engine)),
                        shards={str(r): e for r, e in enumerate(comm.all_gather_object(
                            hzero_ckpt.shard_table_entry(engine)))})
            try:
                hzero_ckpt.save_shard(engine, os.path.join(save_dir, tmp_tag), tdist.get_rank(), rng_state(),
                                      not settings.no_save_optim)
            except OSError as e:  # e.g. the directory could not be created
                failure = (os.path.join(save_dir, tmp_tag), e)
        else:
            try:
                _deepspeed_save(engine, save_dir, tmp_tag, meta, pstate, settings)
            except OSError as e:  # written outside the checkpoint engine (DeepSpeed's directories, scripts)
                failure = (e.filename or os.path.join(save_dir, tmp_tag), e)
    finally:
        engine.checkpoint_engine = own
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


def _deepspeed_save(engine, save_dir: str, tmp_tag: str, meta: dict, pstate: ParallelState,
                    settings: CheckpointSettings) -> None:
    ckpt_engine = safe_io.install(engine)
    # RNG states differ per DP rank but DeepSpeed writes client_state once per model-parallel rank:
    # gather them over DP so every model file carries the whole list (Megatron does the same).
    rngs = comm.all_gather_object(rng_state(), group=pstate.dp.group)
    client_state = {**meta, "rng_states": rngs}
    saved_flag = engine.save_zero_checkpoint
    try:
        ckpt_engine.drop_optimizer = settings.no_save_optim
        if settings.no_save_optim:
            engine.save_zero_checkpoint = False
        engine.save_checkpoint(save_dir, tag=tmp_tag, client_state=client_state, save_latest=False)
    finally:
        ckpt_engine.drop_optimizer = False
        engine.save_zero_checkpoint = saved_flag


def _ranks_per_node(engine) -> int:
    return hierarchical_zero.ranks_per_node(engine.cfg)


def validate_files(ckpt_dir: str) -> None:
    """Collective: the ranks share the checkpoint's files round-robin and open each one with the safe
    loader (mmap: headers and pickles only), so a missing, truncated or corrupt file becomes the same
    one-line error on every rank, before DeepSpeed starts collectives that would hang on it."""
    rank, world = tdist.get_rank(), tdist.get_world_size()
    files = sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".pt"))
    err = None
    if not files:
        err = f"checkpoint directory {ckpt_dir} holds no .pt files"
    for name in files[rank::world]:
        if err:
            break
        try:
            safe_io.safe_load(os.path.join(ckpt_dir, name), mmap=True)
        except CheckpointError as e:
            err = str(e)
    errors = comm.all_gather_object(err)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def load_full_state(model, run: RunConfig, pstate: ParallelState, settings: CheckpointSettings) -> Resume | None:
    """Before deepspeed.initialize: when ``--load`` names a full-state directory (any layout; see full_state.py) or
    an upstream checkpoint (upstream/), copy this rank's shards into ``model``. Returns None for our DeepSpeed
    checkpoints (and without one)."""
    target = classify_load(settings)
    if target.kind == "upstream":
        return load_upstream(target.found, model, run, pstate, settings)
    if target.kind != "full_state":
        return None
    verify.verify_collective(settings.load, settings.verify, _say)  # before a byte of it reaches the model
    full, meta = read_full_state(settings.load)
    check_model_shape(meta["model"], run, settings.load)
    check_experts(meta["model"].get("moe") or {}, run.parallel.ep, run, settings.load)  # experts merged: any EP
    load_into_model(model, full, run.model.num_layers, pstate.tp.size, pstate.tp.rank, settings.load)
    if settings.finetune:
        return Resume(0, 0, settings.load)
    return Resume(int(meta.get("iteration", 0)), int(meta.get("consumed_samples", 0)), settings.load,
                  int(meta.get("lr_num_steps", meta.get("iteration", 0))), meta.get("lr_scheduler"))


def load_checkpoint(engine, run: RunConfig, pstate: ParallelState, settings: CheckpointSettings,
                    full: Resume | None = None) -> Resume:
    """Collective. Restores weights, optimizer, LR schedule, RNG states, iteration and consumed samples
    (as the flags allow). Without a checkpoint in ``--load`` the run starts from scratch. ``full``: what
    ``load_full_state`` returned (the weights are in already; only the LR position is left to set)."""
    _name_leftovers(settings)
    if full is not None:
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(full.lr_state or {"num_steps": full.lr_num_steps})
            apply_schedule_lr(engine)
        optim = "optimizer starts fresh; RNG restored" if full.rng else "optimizer and RNG start fresh"
        got = None if settings.finetune or settings.no_load_optim else full.moments or read_full_moments(full.path)
        if got is not None:  # a resharded checkpoint's Adam moments (tools/reshard_checkpoint.py)
            optim = load_moments(engine, got[0], got[1], pstate.tp.size, pstate.tp.rank, run.model.num_layers,
                                 full.path) + ("; RNG restored" if full.rng else "; RNG starts fresh")
        _say(f"> loaded full-state weights from {full.path}: iteration {full.iteration}, consumed samples "
             f"{full.consumed_samples} ({optim})")
        return full
    target = classify_load(settings)
    if target.kind == "none":
        return Resume()
    if target.kind == "empty":  # preflight has warned (or refused, with --exit-on-missing-checkpoint)
        _say(f"> no checkpoint in {settings.load} (no '{LATEST}' file): starting from scratch")
        return Resume()
    ckpt_dir, tag = target.path, target.tag
    meta = read_meta(ckpt_dir)
    load_optim = loads_optimizer(settings, meta)
    check_resume(meta, run, load_optim, ckpt_dir)
    verify.verify_collective(ckpt_dir, settings.verify, _say)  # sizes and checksums, shared over the ranks
    validate_files(ckpt_dir)
    if getattr(engine, "lr_scheduler", None) is not None:  # an older, iteration-counting schedule state: per step
        engine.lr_scheduler.legacy_samples_per_step = int(meta["run"]["training"]["global_batch_size"])
    if hzero_ckpt.is_engine(engine):  # every rank reads only its own shard file
        hzero_ckpt.check_engine_layout(engine, meta, _ranks_per_node(engine), ckpt_dir)
        shard = hzero_ckpt.load_shard(engine, ckpt_dir, tdist.get_rank(), load_optim, not settings.finetune)
        path, client = ckpt_dir, {**meta, "rng_state": shard["rng"]}
    else:
        safe_io.install(engine)
        path, client = engine.load_checkpoint(settings.load, tag=tag, load_optimizer_states=load_optim,
                                              load_lr_scheduler_states=not settings.finetune,
                                              load_module_only=settings.finetune)
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load {ckpt_dir}; check that its files are complete")
    apply_schedule_lr(engine)
    if settings.finetune:
        _say(f"> loaded weights from {ckpt_dir} (--finetune: iteration, optimizer and RNG start fresh)")
        return Resume(0, 0, ckpt_dir)
    rng = None
    if not settings.no_load_rng and "rng_state" in client:  # hierarchical ZeRO: this rank's own
        rng = client["rng_state"]
    elif not settings.no_load_rng:
        rng = rng_for_rank(client["rng_states"], pstate.dp.rank, pstate.dp.size)
        if rng is None:
            _say(f"> WARNING: {ckpt_dir} was saved with {len(client['rng_states'])} data-parallel ranks, now "
                 f"{pstate.dp.size}: RNG states not restored (dropout masks will differ from a straight run)")
    _say(f"> loaded {ckpt_dir}: iteration {client['iteration']}, consumed samples {client['consumed_samples']}"
         f"{'' if load_optim else ' (optimizer not loaded)'}")
    return Resume(int(client["iteration"]), int(client["consumed_samples"]), ckpt_dir, rng=rng)


def _name_leftovers(settings: CheckpointSettings) -> None:
    """One line naming the temporary directories of saves that never committed (a killed run, a lost node); they are
    never loaded, ``latest`` is left alone, and the next save's retention removes them."""
    for where in dict.fromkeys(d for d in (settings.load, settings.save) if d):
        names = leftovers(where)
        if names:
            latest = latest_or_none(where)
            _say(f"> {where}: {len(names)} unfinished save(s) of an interrupted run: {', '.join(names)}; not loaded, "
                 f"{f'latest still names {latest}' if latest else 'no latest'}; the next save removes them")


def apply_schedule_lr(engine) -> None:
    """The first resumed update uses the current schedule's lr (e.g. after a longer --train-iters).

    Every engine's resume ends here (DeepSpeed ZeRO-0..3, pipeline, hierarchical ZeRO): DeepSpeed restores
    the ZeRO optimizer partitions, param_groups' lr included, *after* the LR scheduler, so without this the
    first step ran at the lr the old schedule gave the saved step's successor."""
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and hasattr(scheduler, "apply_schedule"):
        scheduler.apply_schedule()


def _say(msg: str) -> None:
    if rank0():
        print(msg, flush=True)
