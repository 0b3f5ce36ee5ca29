"""The commit of a save, shared by the synchronous and the background (--async-save) path: rank 0 writes the metadata
and the integrity manifest, renames the temporary directory, moves ``latest`` last, then applies retention; a
failed write anywhere becomes the same one line on every rank."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil

import torch
import torch.distributed as tdist

from megatron.checkpointing.live import atomic, integrity, space
from megatron.checkpointing.live.markers import LATEST, META, TRACKER, read_latest
from megatron.config import CheckpointSettings, RunConfig
from megatron.core import comm
from megatron.errors import CheckpointError

TAG = re.compile(r"^global_step(\d+)$")
Failure = tuple[str, OSError]
"""(path, error) of a save's first failed write on one rank."""


def rank0() -> bool:
    return tdist.get_rank() == 0


def say(msg: str) -> None:
    """A log line from rank 0 only."""
    if rank0():
        print(msg, flush=True)


def commit(save_dir: str, tmp_tag: str, tag: str, iteration: int, meta: dict, files: dict[str, dict],
           keep_last: int | None) -> Failure | None:
    """Rank 0, once every rank's files of ``save_dir/tmp_tag`` are durable (``files``: their manifest entries):
    metadata, manifest, rename to ``tag``, ``latest`` (the commit point), Megatron's tracker, retention. Returns the
    failure (the directory is back under its temporary name, ``latest`` unmoved) or None."""
    tmp, final = os.path.join(save_dir, tmp_tag), os.path.join(save_dir, tag)
    try:
        integrity.write_bytes(os.path.join(tmp, META), json.dumps(meta, indent=1, sort_keys=True).encode())
        files = {**files, **integrity.recorded(tmp)}
        integrity.write_manifest(tmp, files)  # before the rename and `latest`: a committed checkpoint has one
        atomic.fsync_dir(tmp)
        if os.path.exists(final):  # the same iteration saved before (e.g. a resumed run): replace it
            old = f"{final}.old-{tmp_tag.rsplit('-', 1)[1]}"
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
        atomic.fsync_dir(save_dir)
        atomic.atomic_write_text(os.path.join(save_dir, LATEST), tag)  # moves last: the commit point
        # Megatron's marker too (its iteration, as upstream writes it), which upstream's resume loops read
        atomic.atomic_write_text(os.path.join(save_dir, TRACKER), str(iteration))
    except OSError as e:
        if os.path.isdir(final) and not os.path.exists(tmp) and latest_or_none(save_dir) != tag:
            os.replace(final, tmp)  # renamed but not committed: removed with the temporary directory
        return (e.filename or tmp, e)
    retain(save_dir, keep_last, current_tmp=tmp_tag)
    return None


def check_saved(failure: Failure | None, save_dir: str, tmp: str, free: int | None, run: RunConfig,
                settings: CheckpointSettings) -> None:
    """Collective: when a write failed on any rank, remove the temporary directory and raise the same one-line
    error on every rank (``latest`` has not moved). Rank 0's free-space figure travels in the same all-reduce."""
    err = (failure[1].errno or errno.EIO) if failure is not None else 0
    worst, free_max = comm.reduce_host([err, -1 if free is None else free], op=tdist.ReduceOp.MAX,
                                       dtype=torch.int64)
    if not worst:
        return
    paths = comm.all_gather_object(failure[0] if failure is not None else None)  # only on the failure path
    where = next((f"{path} on rank {r}" for r, path in enumerate(paths) if path), tmp)
    integrity.recorded(tmp)  # forget this save's records
    if rank0():
        shutil.rmtree(tmp, ignore_errors=True)
    raise CheckpointError(space.save_failed_message(
        save_dir, tmp, int(worst), space.checkpoint_bytes(run, not settings.no_save_optim),
        None if free_max < 0 else int(free_max), latest_or_none(save_dir), where))


def latest_or_none(save_dir: str) -> str | None:
    try:
        return read_latest(save_dir)
    except CheckpointError:
        return None


def retain(save_dir: str, keep_last: int | None, current_tmp: str | None) -> None:
    """Delete checkpoints beyond the newest ``keep_last`` and leftovers of interrupted saves. Never the checkpoint
    ``latest`` names (whatever its age) nor ``current_tmp``, the save being written."""
    names = os.listdir(save_dir)
    for name in names:
        if ".tmp-" in name and name != current_tmp or ".old-" in name:
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    if keep_last is None:
        return
    latest = latest_or_none(save_dir)
    steps = sorted((int(m.group(1)), n) for n in names if (m := TAG.match(n)))
    for _, name in steps[:-keep_last]:
        if name != latest:
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def leftovers(save_dir: str | None) -> list[str]:
    """Temporary directories of saves that never committed (a kill, a lost node, a full disk before cleanup)."""
    if not save_dir or not os.path.isdir(save_dir):
        return []
    return sorted(n for n in os.listdir(save_dir) if ".tmp-" in n and os.path.isdir(os.path.join(save_dir, n)))


def name_leftovers(settings: CheckpointSettings) -> None:
    """One line naming the temporary directories of saves that never committed (a killed run, a lost node); they are
    never loaded, ``latest`` is left alone, and the next save's retention removes them."""
    for where in dict.fromkeys(d for d in (settings.load, settings.save) if d):
        names = leftovers(where)
        if names:
            latest = latest_or_none(where)
            say(f"> {where}: {len(names)} unfinished save(s) of an interrupted run: {', '.join(names)}; not loaded, "
                f"{f'latest still names {latest}' if latest else 'no latest'}; the next save removes them")


def errno_of(failure: Failure | None) -> int:
    return 0 if failure is None else failure[1].errno or errno.EIO
