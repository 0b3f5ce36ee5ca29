"""--async-save: a save blocks the loop only while each rank copies its state to host memory; a background thread
writes the files (hashed and fsynced, as a synchronous save writes them) and the commit follows once every rank's
files are durable, which the ranks learn from the flags all-reduce the loop already does every iteration.

One save's life, in phases agreed by that all-reduce (``status`` goes in, ``on_agreed`` reads the MAX over ranks)::

    Checkpointer.save (collective) DeepSpeed / hierarchical ZeRO hand each file's state to RecordingCheckpointEngine,
                                  which copies it to host memory (HostCopier) and records (state, path); no file
                                  is written. Then the writer thread starts.
    WRITING                       every rank's thread writes its files, then its manifest entries (a small
                                  ``.records-rankRRRRR.json``, fsynced); busy = 1 until then.
    all ranks not busy            rank 0's thread commits (commit.py: metadata, manifest, rename, ``latest``,
                                  tracker, retention), exactly as a synchronous save does.
    COMMITTING -> not busy        the save is done on every rank.
    any rank's errno != 0         every rank raises the synchronous save's one-line error (commit.check_saved):
                                  the temporary directory goes, ``latest`` stays on the previous checkpoint.

At most one save is in flight: the next save, and every end of a run, first ``finish`` it (collective; logged with
the time waited).

Why a thread, not a process (bench/async_save.py, bench/RESULTS.md): the writer's work is the write and fsync system
calls and XXH3, which release the GIL; a process would need the host copy in shared memory (a second copy, or
buffers that must be allocated shared and pinned), and its own path back for errors and manifest records. A thread
also dies with its rank, so a killed rank can never commit anything. The thread runs at nice 19, so where training
keeps the cores busy (this CPU VM) it takes the time training leaves.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist

from megatron.checkpointing.live import atomic, integrity, space
from megatron.checkpointing.live.commit import Failure, check_saved, commit, errno_of, rank0, say
from megatron.checkpointing.live.host_copy import HostCopier, host_available_bytes, host_total_bytes
from megatron.checkpointing.live.safe_io import SafeCheckpointEngine
from megatron.config import RunConfig
from megatron.core import comm

RECORDS = ".records-rank{rank:05d}.json"
"""Each rank's manifest entries of one save, read and removed by rank 0's commit (no gather in the step)."""
_IDLE, _WRITING, _COMMITTING = "idle", "writing", "committing"
_RESERVE_FRACTION, _RESERVE_MIN = 0.05, 1 << 30
"""Host memory left free when deciding whether a copy fits: 5% of the node's memory, at least 1 GiB."""


@dataclass
class PendingSave:
    """One save between its copy and its commit."""
    tag: str
    tmp_tag: str
    iteration: int
    meta: dict
    free: int | None
    """Rank 0: free bytes on --save's file system when the save began (for the one line of a failure)."""
    items: list = field(default_factory=list)
    """(host copy of a file's state, path) still to be written."""
    failure: Failure | None = None
    zipfile: bool = True
    """torch's zip serialization (DeepSpeed's checkpoint.checkpoint_serialization), as the engine's own writer."""
    host_bytes: int = 0
    written_bytes: int = 0
    started: float = field(default_factory=time.monotonic)


class RecordingCheckpointEngine(SafeCheckpointEngine):
    """A checkpoint engine whose ``save`` copies the state to host memory and records it with its path instead of
    writing. DeepSpeed's ZeRO-0..3 and pipeline engines and hierarchical ZeRO all pass every file through
    ``checkpoint_engine.save(state, path)``, so the engine-specific gathering stays theirs. When host memory cannot
    hold a copy this rank falls back to writing synchronously (safe_io's engine), with one log line."""

    def __init__(self, like: SafeCheckpointEngine, copier: HostCopier, ranks_per_node: int, rank: int) -> None:
        # No TorchCheckpointEngine.__init__: it only reads the serialization from the config and logs a line per save
        self.name = type(self).__name__
        self.zipfile_serialization = like.zipfile_serialization
        self.copier, self.ranks_per_node, self.rank = copier, ranks_per_node, rank
        self.items: list = []
        self.host_bytes = 0
        self.synchronous = False

    def save(self, state_dict, path: str) -> None:
        if self.failure is not None:
            return
        state = state_dict
        if self.drop_optimizer and isinstance(state, dict) and state.get("optimizer") is not None:
            state = {**state, "optimizer": None}
        name = os.path.basename(path)
        if not self.synchronous:
            need = self.copier.bytes_needed(state, name)
            self.synchronous = not self._fits(need, path)
        if self.synchronous:
            super().save(state, path)
            return
        self.items.append((self.copier.copy(state, name), path))
        self.host_bytes += HostCopier.bytes_of(state)

    def _fits(self, need: int, path: str) -> bool:
        """Every rank of this node copies its shard at once: this rank's copy fits if the node's free memory, less a
        reserve, holds ``ranks_per_node`` of them."""
        avail, total = host_available_bytes(), host_total_bytes()
        if need == 0 or avail is None:
            return True
        reserve = max(_RESERVE_MIN, int(_RESERVE_FRACTION * (total or 0)))
        if need * self.ranks_per_node <= avail - reserve:
            return True
        print(f"> --async-save: rank {self.rank}: host memory cannot hold the copy of {path} "
              f"({space.fmt(need)} x {self.ranks_per_node} ranks per node, {space.fmt(avail)} available, "
              f"{space.fmt(reserve)} kept free): this rank writes this save synchronously", flush=True)
        return False


class AsyncSaver:
    """The one background save of a rank (see the module docstring). ``ranks_per_node``: ranks sharing this host's
    memory (from the launcher)."""

    def __init__(self, run: RunConfig, ranks_per_node: int = 1) -> None:
        self.run, self.ranks_per_node = run, max(1, ranks_per_node)
        self.copier = HostCopier()
        self._pending: PendingSave | None = None
        self._phase = _IDLE
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._sized = False
        self.on_committed: Callable[[float, int], None] | None = None
        """Called on every rank with (seconds from the save's start to its commit, iteration): a save's whole cost,
        which a deadline predicts the next one from."""

    # ------------------------------------------------------------------ the save itself (collective, blocking)
    def recorder(self, like: SafeCheckpointEngine) -> RecordingCheckpointEngine:
        """The checkpoint engine for one save (``like``: the engine's own, whose serialization it keeps)."""
        assert self._pending is None, "finish() the previous save first"
        return RecordingCheckpointEngine(like, self.copier, self.ranks_per_node, tdist.get_rank())

    def launch(self, pending: PendingSave, recorder: RecordingCheckpointEngine) -> None:
        """Collective: start writing what ``recorder`` copied. The first save logs the host copy's size."""
        pending.items, pending.host_bytes = recorder.items, recorder.host_bytes
        pending.zipfile = recorder.zipfile_serialization
        pending.meta = copy.deepcopy(pending.meta)  # written at the commit, steps later: no live references
        if not self._sized:
            self._sized = True
            most = comm.reduce_host([pending.host_bytes], op=tdist.ReduceOp.MAX, dtype=torch.int64)[0]
            say(f"> --async-save: host copy of {pending.tag}: {space.fmt(int(most))} on the largest rank; "
                 "the loop blocked only for the copy, a background thread writes it")
        self._pending, self._phase = pending, _WRITING
        self._cancel.clear()
        self._start(self._write, pending)

    # ------------------------------------------------------------------ every iteration (through RunControl)
    def status(self) -> list[float]:
        """This rank's contribution to the flags all-reduce (MAX): [busy, errno]."""
        p = self._pending
        if p is None:
            return [0.0, 0.0]
        busy = self._thread is not None and self._thread.is_alive()
        return [float(busy), float(errno_of(p.failure))]

    def on_agreed(self, values) -> None:
        """After the all-reduce: advance the phase on every rank alike. Raises the save's one-line CheckpointError on
        every rank when any rank failed (collective then, as every rank sees the same values)."""
        if self._pending is None:
            return
        busy, err = (int(v) for v in values[:2])
        if err:
            self._fail()
        if busy:
            return
        p = self._pending
        if self._phase == _WRITING:  # every rank's files are durable: rank 0 commits
            self._phase = _COMMITTING
            if rank0():
                self._start(self._commit, p)
            return
        self._pending, self._phase = None, _IDLE
        took = time.monotonic() - p.started
        say(f"> saved {p.tag} in the background: committed {took:.2f} s after the save "
             f"began ({space.fmt(p.written_bytes)} written by rank 0)")
        if self.on_committed is not None:
            self.on_committed(took, p.iteration)

    # ------------------------------------------------------------------ ends of runs, the next save
    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def finish(self, why: str) -> None:
        """Collective: wait for the save in flight and commit it (every rank calls this at the same point: before the
        next save, at every end of a run). Logs the time waited. The one call a deadline stop makes too."""
        if self._pending is None:
            return
        tag, t0 = self._pending.tag, time.monotonic()
        while self._pending is not None:
            self._join()
            self.on_agreed(comm.reduce_host(self.status(), op=tdist.ReduceOp.MAX))
        say(f"> waited {time.monotonic() - t0:.2f} s for the background save of {tag} {why}")

    def drain_estimate_s(self) -> float | None:
        """Seconds this rank's save in flight still needs at its write rate so far (0.0: none in flight; None: no file
        written yet, the rate is unknown). The hook for a save-time prediction (a deadline stop): a stop first
        ``finish``es the save in flight, so the prediction adds this (its MAX over ranks)."""
        p = self._pending
        if p is None:
            return 0.0
        left = max(0, p.host_bytes - p.written_bytes)
        if not left:  # written: what is left is the commit's metadata
            return 0.0
        elapsed = time.monotonic() - p.started
        if not p.written_bytes or elapsed <= 0:
            return None
        return left / (p.written_bytes / elapsed)

    # ------------------------------------------------------------------ the thread's work
    def _start(self, target, pending: PendingSave) -> None:
        self._thread = threading.Thread(target=_background, args=(target, pending), name="checkpoint-writer",
                                        daemon=True)
        self._thread.start()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _write(self, p: PendingSave) -> None:
        """Write every recorded file (hashed while written, fsynced), then this rank's manifest entries."""
        while p.items and p.failure is None and not self._cancel.is_set():
            state, path = p.items.pop(0)  # dropped once written: the copy's memory goes file by file
            try:
                integrity.write_torch(state, path, zipfile=p.zipfile)
                p.written_bytes += os.path.getsize(path)
            except OSError as e:
                p.failure = (e.filename or path, e)
            except Exception as e:  # never a silent stop: any writer error fails the save on every rank
                p.failure = (path, OSError(errno.EIO, f"{type(e).__name__}: {e}"))
            del state
        p.items = []
        if p.failure is not None or self._cancel.is_set():
            return
        tmp = os.path.join(self.run.checkpoint.save, p.tmp_tag)
        records = integrity.recorded(tmp)
        path = os.path.join(tmp, RECORDS.format(rank=tdist.get_rank()))
        try:
            atomic.atomic_write_bytes(path, json.dumps(records).encode())
        except OSError as e:
            p.failure = (path, e)

    def _commit(self, p: PendingSave) -> None:
        save_dir = self.run.checkpoint.save
        tmp = os.path.join(save_dir, p.tmp_tag)
        files: dict[str, dict] = {}
        try:
            for r in range(tdist.get_world_size()):
                path = os.path.join(tmp, RECORDS.format(rank=r))
                with open(path) as f:
                    files.update(json.load(f))
                os.remove(path)
        except (OSError, ValueError) as e:
            p.failure = (getattr(e, "filename", None) or tmp, e if isinstance(e, OSError) else
                         OSError(errno.EIO, f"unreadable manifest records: {e}"))
            return
        p.failure = commit(save_dir, p.tmp_tag, p.tag, p.iteration, p.meta, files, self.run.checkpoint.keep_last)

    def _fail(self) -> None:
        """Collective, every rank at the same iteration: the one-line error of a failed save (commit.check_saved)."""
        self._cancel.set()
        self._join()
        p, self._pending, self._phase = self._pending, None, _IDLE
        tmp = os.path.join(self.run.checkpoint.save, p.tmp_tag)
        check_saved(p.failure, self.run.checkpoint.save, tmp, p.free, self.run, self.run.checkpoint)


def _background(target, pending: PendingSave) -> None:
    """Run ``target(pending)`` at the lowest CPU priority: where training keeps every core busy (a CPU run; a GPU
    node's cores are mostly idle) the writer, its system calls included, takes the time training leaves. Linux
    keeps a nice value per thread, so only this thread is lowered; elsewhere it runs at the rank's priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
    target(pending)
