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
import re

import torch

from megatron.checkpointing import integrity
from megatron.checkpointing.hierarchical_zero import FORMAT as HZERO
from megatron.checkpointing.hierarchical_zero import shard_file
from megatron.core import comm
from megatron.errors import CheckpointError

MODES = ("full", "size", "off")
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


# ---------------------------------------------------------------------------------- layout without a manifest
def expected_files(meta: dict, present: set[str]) -> list[str]:
    """Files a checkpoint without a manifest must hold, from the layout in its megatron_meta.json (DeepSpeed's
    names: model files per model-parallel rank, ZeRO files per DP x MP rank, pipeline layer files per TP rank;
    hierarchical ZeRO: one file per rank). ``present`` (the directory's names) settles what the layout leaves
    open: the bf16_ prefix DeepSpeed's bf16 optimizer adds, and how many pipeline layer files there are."""

    p = (meta.get("run") or {}).get("parallel") or {}
    tp, pp = int(p.get("tensor_model_parallel_size", 1)), int(p.get("pipeline_model_parallel_size", 1))
    world, zero = int(p.get("world_size", tp * pp)), int(p.get("zero_stage", 0))
    dp, mp = max(1, world // (tp * pp)), tp * pp
    if meta.get("format") == HZERO:
        return [os.path.basename(shard_file("", r)) for r in range(world)]
    names = []
    if zero == 3:
        names += [f"zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt" for d in range(dp) for m in range(mp)]
    else:
        names += [f"mp_rank_{m:02d}_model_states.pt" for m in range(mp)]
    if zero >= 1 and meta.get("has_optimizer", True):
        prefix = "bf16_" if any(n.startswith("bf16_zero_pp_rank_") for n in present) else ""
        names += [f"{prefix}zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt" for d in range(dp) for m in range(mp)]
    layers = [int(m.group(1)) for n in present if (m := re.match(r"layer_(\d+)-model_\d+-model_states\.pt$", n))]
    if layers:  # pipeline engine: every layer index up to the last one seen, each for every TP rank
        names += [f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(max(layers) + 1) for t in range(tp)]
    return names


def missing_or_short(ckpt_dir: str, meta: dict, files: dict[str, dict] | None) -> list[tuple[str, str]]:
    """(name, problem) of files that are missing or have the wrong size (stat only, no read)."""
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
    for name in expected_files(meta, set(present)):
        if name not in present:
            bad.append((name, _KINDS[1]))
        elif present[name].stat().st_size == 0:
            bad.append((name, "is empty (0 bytes)"))
    return bad


def check_complete(ckpt_dir: str, meta: dict | None) -> None:
    """Preflight: a missing or short file is one line naming it (exit 2), before any process group. ``meta``:
    the DeepSpeed layout's megatron_meta.json (None for a full-state directory: only its manifest can tell)."""
    files = integrity.read_manifest(ckpt_dir)
    if files is None and meta is None:
        return
    bad = missing_or_short(ckpt_dir, meta or {}, files)
    if bad:
        raise CheckpointError(damaged_message(ckpt_dir, bad))


# ---------------------------------------------------------------------------------- collective verification
def verify_collective(ckpt_dir: str, mode: str, say) -> None:
    """Collective: verify ``ckpt_dir`` against its manifest, the work shared over all ranks; every rank raises
    the same CheckpointError when a file is damaged. ``say``: rank 0's logger."""
    import torch.distributed as tdist


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


# ---------------------------------------------------------------------------------- offline
def offline_problems(ckpt_dir: str, meta: dict | None, mode: str = "full") -> tuple[list[tuple[str, str]], bool]:
    """(every problem, whether a manifest was found) of one checkpoint directory, one process."""
    files = integrity.read_manifest(ckpt_dir)
    if files is None:
        return (missing_or_short(ckpt_dir, meta or {}, None) if meta is not None else []), False
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
