"""Is a checkpoint whole? Three checks of one question, from cheapest to complete:

* ``missing_or_short`` (preflight, every rank, no process group): every file the manifest lists exists with
  its size; without a manifest (older checkpoints, upstream's), every file the saved TP x PP x DP x ZeRO layout
  implies exists and is not empty. Stats only: seconds, before the launcher's rendezvous.
* ``verify_collective`` (after the process group, before any weight reaches the engine): the ranks share the
  manifest's files by bytes, each hashes its share, and one all-reduce of per-file verdicts gives every rank the
  same answer, so a damaged file is the same one line and exit 2 on all of them.
* ``offline_problems`` (tools/verify_checkpoint.py): every file, one process, every problem listed.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as tdist

from megatron.checkpointing.live import integrity
from megatron.checkpointing.live.safe_io import safe_load
from megatron.core import comm
from megatron.errors import CheckpointError

MODES = ("full", "size", "off")
Layout = Callable[[set[str]], list[str]]
"""The files a checkpoint without a manifest must hold, given the names its directory holds (a format's layout:
ds_layout/files.py, hzero/shards.py; locate.expected_files picks it from the metadata)."""
_KINDS = ("", "is missing", "has the wrong size (truncated or overwritten)", "fails its checksum (damaged bytes)",
          "is unreadable")


def _kind(problem: str) -> int:
    return 1 if problem == "missing" else 2 if "bytes, the manifest" in problem else \
        3 if problem.startswith("checksum") else 4


def _fix(load_dir: str) -> str:
    return (f"copy it again, or load an older checkpoint (edit {os.path.join(load_dir, 'latest')}); "
            f"python tools/verify_checkpoint.py {load_dir} lists every damaged file")


def damaged_message(ckpt_dir: str, bad: list[tuple[str, str]]) -> str:
    """One line for the first damaged file (and how many more)."""
    name, what = bad[0]
    more = f" (and {len(bad) - 1} more damaged file{'s' * (len(bad) > 2)})" if len(bad) > 1 else ""
    return (f"checkpoint file {os.path.join(ckpt_dir, name)} {what}{more}: checkpoint {ckpt_dir} is damaged; "
            f"{_fix(os.path.dirname(ckpt_dir.rstrip(os.sep)))}")


# ---------------------------------------------------------------------------------- without a process group
def missing_or_short(ckpt_dir: str, layout: Layout | None, files: dict[str, dict] | None) -> list[tuple[str, str]]:
    """(name, problem) of files that are missing or have the wrong size (stat only, no read): those the manifest
    ``files`` lists, or without one those ``layout`` implies."""
    try:
        present = {e.name: e for e in os.scandir(ckpt_dir)}
    except OSError as e:
        return [(".", f"is unreadable ({e.strerror})")]
    bad = []
    if files is not None:
        for name in sorted(files):
            entry = present.get(name) if os.sep not in name else None
            path = os.path.join(ckpt_dir, name)
            if entry is None and not os.path.exists(path):
                bad.append((name, _KINDS[1]))
                continue
            size = entry.stat().st_size if entry is not None else os.path.getsize(path)
            if size != files[name]["size"]:
                bad.append((name, f"has {size} bytes, the manifest says {files[name]['size']}"
                                  f"{' (truncated)' if size < files[name]['size'] else ''}"))
        return bad
    for name in layout(set(present)):
        if name not in present:
            bad.append((name, _KINDS[1]))
        elif present[name].stat().st_size == 0:
            bad.append((name, "is empty (0 bytes)"))
    return bad


def check_complete(ckpt_dir: str, layout: Layout | None) -> None:
    """Preflight: a missing or short file is one line naming it (exit 2), before any process group. ``layout``:
    the files a checkpoint of ours implies (None for a full-state directory: only its manifest can tell)."""
    files = integrity.read_manifest(ckpt_dir)
    if files is None and layout is None:
        return
    bad = missing_or_short(ckpt_dir, layout, files)
    if bad:
        raise CheckpointError(damaged_message(ckpt_dir, bad))


# ---------------------------------------------------------------------------------- collective verification
def verify_collective(ckpt_dir: str, mode: str, say) -> None:
    """Collective: verify ``ckpt_dir`` against its manifest, the work shared over all ranks; every rank raises
    the same CheckpointError when a file is damaged. ``say``: rank 0's logger."""
    if mode == "off":
        say(f"> --verify-checkpoint off: the files of {ckpt_dir} are not checked against their manifest")
        return
    files = integrity.read_manifest(ckpt_dir)
    if files is None:
        say(f"> {ckpt_dir} has no integrity manifest ({integrity.MANIFEST}; an older or upstream checkpoint): "
            "checked for completeness and file sizes only")
        return
    names = sorted(files)
    mine = integrity.shares(files, tdist.get_world_size())[tdist.get_rank()]
    found = integrity.problems(ckpt_dir, files, mine, mode)
    verdict = [0] * len(names)
    index = {n: i for i, n in enumerate(names)}
    for name, problem in found.items():
        verdict[index[name]] = _kind(problem)
    agreed = comm.reduce_host(verdict, op=tdist.ReduceOp.MAX, dtype=torch.int32) if names else []
    bad = [(names[i], _KINDS[int(k)]) for i, k in enumerate(agreed) if k]
    if bad:
        raise CheckpointError(damaged_message(ckpt_dir, bad))
    say(f"> verified {len(names)} files of {ckpt_dir} ({integrity.total_bytes(files) / 2**30:.2f} GiB, "
        f"{'sizes and ' + integrity.ALGORITHM if mode == 'full' else 'sizes'})")


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
            safe_load(os.path.join(ckpt_dir, name), mmap=True)
        except CheckpointError as e:
            err = str(e)
    errors = comm.all_gather_object(err)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


# ---------------------------------------------------------------------------------- offline
def offline_problems(ckpt_dir: str, layout: Layout | None, mode: str = "full") -> tuple[list[tuple[str, str]], bool]:
    """(every problem, whether a manifest was found) of one checkpoint directory, one process."""
    files = integrity.read_manifest(ckpt_dir)
    if files is None:
        return (missing_or_short(ckpt_dir, layout, None) if layout is not None else []), False
    bad = integrity.problems(ckpt_dir, files, sorted(files), mode)
    return sorted(bad.items()), True


def require_whole(ckpt_dir: str) -> None:
    """Offline readers (tools/reshard_checkpoint.py, tools/convert_*): a checkpoint with a manifest is checked in
    full before it is converted; the first damaged file is one line."""
    files = integrity.read_manifest(ckpt_dir)
    if files is not None:
        bad = integrity.problems(ckpt_dir, files, sorted(files), "full")
        if bad:
            raise CheckpointError(damaged_message(ckpt_dir, sorted((n, _KINDS[_kind(p)]) for n, p in bad.items())))
