"""Check that a checkpoint is whole, e.g. after copying it between file systems (Orion, NVMe, HPSS).

    python tools/verify_checkpoint.py DIR [--tag global_step100] [--size-only]

DIR: a --save directory (the checkpoint its 'latest' names, or --tag's), one tag directory, a full-state
directory (tools/reshard_checkpoint.py) or an HF export. Every file of the checkpoint's integrity manifest is
checked for its size and xxHash checksum (XXH3-128, the hash the writing rank took while saving). A checkpoint
without a manifest (an older one, upstream's) is checked for the files its TP x PP x DP x ZeRO layout needs.

Exit 0 when whole (one summary line); exit 1 with every damaged file on its own line otherwise (stdout:
``PATH: problem``); exit 2 when DIR holds no checkpoint.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.errors import run_cli  # noqa: E402


def checkpoint_dir(path: str, tag: str | None) -> str:
    from megatron.checkpointing.full_state.files import FULL_STATE_META
    from megatron.checkpointing.live.integrity import MANIFEST
    from megatron.checkpointing.live.markers import META, read_latest
    from megatron.errors import CheckpointError

    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory")
    if tag:
        return os.path.join(path, tag)
    if any(os.path.exists(os.path.join(path, n)) for n in (MANIFEST, META, FULL_STATE_META)):
        return path
    tag = read_latest(path)
    if tag is None:
        raise CheckpointError(f"{path}: no 'latest' file, no {MANIFEST} and no {META}: not a checkpoint directory "
                              "(pass a --save directory, a tag directory, or --tag)")
    return os.path.join(path, tag)


def main(argv=None) -> int:
    from megatron.checkpointing.live import integrity
    from megatron.checkpointing.live.markers import META, read_meta
    from megatron.checkpointing.live.verify import offline_problems
    from megatron.checkpointing.locate import expected_files
    from megatron.errors import CheckpointError

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("dir", help="a --save directory, one tag directory, a full-state directory or an HF export")
    p.add_argument("--tag", default=None, help="default: the one 'latest' names")
    p.add_argument("--size-only", action="store_true", help="check sizes, not checksums (seconds, no reads)")
    args = p.parse_args(argv)
    ckpt = checkpoint_dir(args.dir, args.tag)
    if not os.path.isdir(ckpt):
        raise CheckpointError(f"checkpoint directory {ckpt} is missing")
    meta = None
    if not os.path.exists(os.path.join(ckpt, integrity.MANIFEST)) and os.path.exists(os.path.join(ckpt, META)):
        meta = read_meta(ckpt)  # only a checkpoint without a manifest needs its layout
    start = time.perf_counter()
    bad, manifest = offline_problems(ckpt, expected_files(meta) if meta is not None else None,
                                     "size" if args.size_only else "full")
    if not manifest and meta is None:
        raise CheckpointError(f"{ckpt} has neither {integrity.MANIFEST} nor {META}: nothing tells which files it "
                              "needs")
    for name, problem in bad:
        print(f"{os.path.join(ckpt, name)}: {problem}", flush=True)
    if bad:
        print(f"{ckpt}: {len(bad)} damaged file{'s' * (len(bad) > 1)}", file=sys.stderr)
        return 1
    if manifest:
        files = integrity.read_manifest(ckpt)
        what = "sizes" if args.size_only else f"sizes and {integrity.ALGORITHM} checksums"
        print(f"ok: {ckpt}: {len(files)} files, {integrity.total_bytes(files) / 2**30:.3f} GiB, {what} match "
              f"its manifest ({time.perf_counter() - start:.1f} s)")
    else:
        print(f"ok: {ckpt} has no integrity manifest (an older or upstream checkpoint): every file its layout "
              "needs is present and not empty (checksums cannot be checked)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
