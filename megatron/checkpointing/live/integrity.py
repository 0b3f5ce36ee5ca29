"""Integrity manifests: every checkpoint file's size and xxHash (XXH3-128), taken while it is written.

Writers hand ``torch.save`` a ``HashingWriter`` (a file-like object) instead of a path, so each byte is hashed
as it streams to the file: no second read. Each process keeps what it wrote (``recorded``); the save protocol
(directory.py) gathers the records of every rank and writes ``DIR/<tag>/integrity.json`` before ``latest``
moves::

    {"format": "megatron-frontier/integrity-v1", "algorithm": "xxh3_128",
     "files": {"mp_rank_00_model_states.pt": {"size": 123, "xxh3_128": "9f0c..."}, ...}}

Why xxHash (the ``xxhash`` package, bindings of the reference C library): XXH3 hashes at ~18 GB/s on one core
of this machine, ~5x zlib's CRC-32, so checking a checkpoint costs far less than reading it; it is maintained
and ships wheels for every platform. It detects accidental damage (bit flips, truncation, a stale copy), not
tampering: a checkpoint is read with ``weights_only`` for that (safe_io.py).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import xxhash

from megatron.checkpointing.live.atomic import atomic_write_bytes
from megatron.errors import CheckpointError
from megatron.progress import PROGRESS

MANIFEST = "integrity.json"
FORMAT = "megatron-frontier/integrity-v1"
ALGORITHM = "xxh3_128"
_CHUNK = 16 << 20

_OVERLAP = 1 << 20
"""Writes of at least this many bytes are hashed on the helper thread, smaller ones inline."""
_pool: ThreadPoolExecutor | None = None

_written: dict[str, tuple[int, str]] = {}
"""abspath -> (size, digest) of the files this process wrote and has not yet handed to a manifest."""
_written_lock = threading.Lock()
"""--async-save's writer thread records while the training thread may read records of another directory."""


class HashingWriter:
    """A binary file-like object that hashes and counts the bytes it passes to ``f``.

    A large write is hashed on a helper thread while the calling thread writes it: XXH3 and the write system call
    both release the GIL, so on a rank with a spare core the checksum costs no wall time. The write returns only
    after both finished (torch may reuse the buffer afterwards)."""

    def __init__(self, f) -> None:
        self._f = f
        self._h = xxhash.xxh3_128()
        self.size = 0
        self.error: OSError | None = None
        """The OSError a write raised (torch.save may wrap it in a RuntimeError; the caller wants the errno)."""

    def write(self, data) -> int:
        view = memoryview(data)
        n_bytes = view.nbytes
        hashing = _hasher().submit(self._h.update, view) if n_bytes >= _OVERLAP else None
        try:
            n = self._f.write(view)
        except OSError as e:
            self.error = e
            raise
        finally:
            if hashing is not None:
                hashing.result()
        if n is not None and n != n_bytes:  # a short write: the file system took less than it was given
            self.error = OSError(errno.ENOSPC, f"short write ({n} of {n_bytes} bytes)")
            raise self.error
        if hashing is None:
            self._h.update(view)
        self.size += n_bytes
        return n_bytes

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _hasher() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash")
    return _pool


def write_torch(obj, path: str, zipfile: bool = True) -> None:
    """``torch.save(obj, path)`` hashed on the way, fsynced, recorded. Raises the underlying OSError on a failed
    write (ENOSPC, EDQUOT, EIO...), not torch's wrapper of it."""
    import torch

    writer = None
    try:
        with open(path, "wb") as f:
            if PROGRESS.faults is not None:  # a test's slow or failing write (MEGATRON_FAULT phase=write)
                PROGRESS.faults.at("write", PROGRESS, path)
            writer = HashingWriter(f)
            torch.save(obj, writer, _use_new_zipfile_serialization=zipfile)
            f.flush()
            os.fsync(f.fileno())
    except Exception as e:
        if writer is not None and writer.error is not None and writer.error is not e:
            raise writer.error from None
        raise
    _record(path, writer.size, writer.hexdigest())


def write_safetensors(tensors: dict, path: str, metadata: dict | None = None) -> None:
    """A safetensors file, hashed as it is written (safetensors builds the file in memory, then one write)."""
    from safetensors.torch import save

    write_bytes(path, save(tensors, metadata=metadata))


def write_bytes(path: str, data: bytes, record: bool = True) -> None:
    """Write, fsync and (unless told not to) record a file through a temporary name: a reader sees the old or
    the new content, never half."""
    atomic_write_bytes(path, data)
    if record:
        _record(path, len(data), digest(data))


def digest(data: bytes) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def record(path: str, size: int, hexdigest: str) -> None:
    with _written_lock:
        _written[os.path.abspath(path)] = (size, hexdigest)


_record = record  # write_bytes' parameter shadows the name


def recorded(under: str, forget: bool = True) -> dict[str, dict]:
    """This process's records of files below ``under``, as manifest entries keyed by the relative path."""
    root = os.path.abspath(under) + os.sep
    out = {}
    with _written_lock:
        for path in [p for p in _written if p.startswith(root)]:
            size, digest = _written.pop(path) if forget else _written[path]
            out[path[len(root):]] = {"size": size, ALGORITHM: digest}
    return out


def hash_files(root: str, names) -> dict[str, dict]:
    """Manifest entries for files written by code that cannot stream through a HashingWriter (one read each)."""
    return {n: dict(zip(("size", ALGORITHM), hash_file(os.path.join(root, n)), strict=True)) for n in names}


def write_manifest(ckpt_dir: str, files: dict[str, dict]) -> None:
    """Written in place and fsynced, without a rename or a directory fsync of its own: the checkpoint directory is
    still temporary (the commit's rename and directory fsync follow), and an export writes its completion marker
    after it, so a torn manifest is never taken for a whole checkpoint."""
    text = json.dumps({"format": FORMAT, "algorithm": ALGORITHM, "files": dict(sorted(files.items()))}, indent=1)
    with open(os.path.join(ckpt_dir, MANIFEST), "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(ckpt_dir: str) -> dict[str, dict] | None:
    """``{name: {"size", "xxh3_128"}}``, or None for a checkpoint written without one (older, upstream's)."""
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        files = data["files"]
        if data.get("algorithm") != ALGORITHM or not all({"size", ALGORITHM} <= set(e) for e in files.values()):
            raise ValueError(f"unknown algorithm {data.get('algorithm')!r} or entries")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt ({e}); copy the checkpoint again or load an older "
                              "one (edit the 'latest' file)") from None
    return files


def hash_file(path: str) -> tuple[int, str]:
    """(size, digest) of a file. Hashed through a read-only mmap: the page cache's pages go to XXH3 with no copy
    into user memory (about 2x faster than read() into a buffer, measured in bench/checkpoint_integrity.py)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0, xxhash.xxh3_128().hexdigest()
        h = xxhash.xxh3_128()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, memoryview(m) as view:
            for start in range(0, size, _CHUNK):
                with view[start:start + _CHUNK] as chunk:  # released at once: the mmap must close cleanly
                    h.update(chunk)
        return size, h.hexdigest()


def check_file(ckpt_dir: str, name: str, entry: dict, mode: str) -> str | None:
    """What is wrong with one file against its manifest entry (None: whole). ``mode``: "full" or "size"."""
    path = os.path.join(ckpt_dir, name)
    try:
        size = os.path.getsize(path)
    except OSError:
        return "missing"
    if size != entry["size"]:
        return f"{size} bytes, the manifest says {entry['size']}" + (" (truncated)" if size < entry["size"] else "")
    if mode == "full":
        try:
            _, digest = hash_file(path)
        except OSError as e:
            return f"unreadable ({e.strerror})"
        if digest != entry[ALGORITHM]:
            return f"checksum mismatch ({ALGORITHM} {digest}, the manifest says {entry[ALGORITHM]}): damaged bytes"
    return None


def shares(files: dict[str, dict], world: int) -> list[list[str]]:
    """Split the files over ``world`` ranks with about equal bytes each (largest first onto the least loaded;
    the same answer on every rank, so no communication is needed to agree on it)."""
    loads, out = [0] * world, [[] for _ in range(world)]
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        r = min(range(world), key=loads.__getitem__)
        out[r].append(name)
        loads[r] += files[name]["size"]
    return out


def problems(ckpt_dir: str, files: dict[str, dict], names, mode: str) -> dict[str, str]:
    """{name: problem} for the damaged files among ``names``."""
    out = {}
    for name in names:
        p = check_file(ckpt_dir, name, files[name], mode)
        if p:
            out[name] = p
    return out


def total_bytes(files: dict[str, dict]) -> int:
    return sum(e["size"] for e in files.values())
