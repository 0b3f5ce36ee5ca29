"""Disk space for checkpoints: what one checkpoint needs (from the model, precision, ZeRO stage and layout),
what the file system of ``--save`` has free, and the one line a save that ran out of space ends in."""

from __future__ import annotations

import errno
import os

from megatron.config import RunConfig

SPACE_ERRNOS = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def checkpoint_bytes(run: RunConfig, with_optimizer: bool = True) -> int:
    """Bytes of one checkpoint of ``run`` (all ranks' files together), as megatron/perf/memory.py counts model
    states: the weights in the training dtype (fp32 at ZeRO-3 and under hierarchical ZeRO, whose files hold the
    fp32 master) plus, with the optimizer, Adam's m and v (8 bytes per parameter) and the fp32 master copy (4)
    whenever the weights are 16-bit or ZeRO partitions the optimizer. Replicas over data parallelism are saved
    once; the pickle framing (kilobytes) is left out."""
    p, precision = run.parallel, run.precision.name
    params = run.model.num_parameters(p.tp)
    weight = 2 if precision in ("bf16", "fp16") else 4
    optim = 0
    if with_optimizer:
        optim = 8 + (4 if weight == 2 or p.zero_stage >= 1 else 0)
    if p.zero_hierarchy:  # per rank: master shard + moments (the optimizer) + the 16-bit secondary shards
        return params * ((optim or 4) + (weight if weight == 2 else 0))
    return params * (weight + optim)


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged user may still write on the file system of ``path`` (None: unknown). A Lustre
    project quota is not seen here; an EDQUOT during the save is reported like a full disk."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def fmt(n: int | None) -> str:
    if n is None:
        return "an unknown number of bytes"
    return f"{n:,} bytes ({n / 2**30:.2f} GiB)"


def low_space_warning(save: str, run: RunConfig, with_optimizer: bool) -> str | None:
    """One line when ``--save``'s file system has less free space than one checkpoint (None: enough, or unknown)."""
    need, free = checkpoint_bytes(run, with_optimizer), free_bytes(save)
    if free is None or free >= need:
        return None
    return (f"--save {save}: its file system has {fmt(free)} free, one checkpoint of this model needs about "
            f"{fmt(need)}: the first save will fail; free space, raise the quota or choose another --save")


def save_failed_message(save_dir: str, tmp_dir: str, err: int, need: int, free: int | None,
                        latest: str | None, where: str) -> str:
    what = "out of space" if err == errno.ENOSPC else "over quota" if err in SPACE_ERRNOS else os.strerror(err)
    name = errno.errorcode.get(err, str(err))
    kept = f"'latest' still names {latest}" if latest else "no earlier checkpoint exists ('latest' not written)"
    fix = ("free space or raise the quota (lfs quota -p), then resume" if err in SPACE_ERRNOS else
           "check the file system, then resume")
    return (f"checkpoint save to {save_dir} failed: {what} ({name}, writing {where}); the checkpoint needs about "
            f"{fmt(need)}, "
            f"{fmt(free)} were free when the save began; removed {tmp_dir}; {kept}: {fix}")
