"""A heartbeat watchdog: when a rank dies (SIGKILL, node loss) every other rank exits non-zero within
about ``timeout`` seconds with one line naming the lost rank, instead of hanging in a collective.

Gloo (and RCCL) collectives may wait forever on a dead peer, so nothing here uses them. Each rank runs a
daemon thread with its own client connection to the job's rendezvous TCPStore (hosted by rank 0, the
``MASTER_ADDR:MASTER_PORT`` store): it bumps its own counter, watches one neighbour (rank r watches
r+1, a ring, so the store sees O(1) operations per rank per beat) and polls one shared abort key. The
rank that finds its neighbour silent publishes the verdict; the others read it on their next beat.
A second thread checks that the first one still reaches the store, which bounds the case where rank 0
(and with it the store) is the one lost. The rank that names the lost rank also writes a failure record (its
host included, published by every rank in the store at start) for the next job's choice of nodes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as tdist

from megatron.training.failure_record import LOST_RANK, FailureLog, this_host

EXIT_CODE = 3


def _die(msg: str) -> None:
    sys.stderr.write(f"error: {msg}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(EXIT_CODE)  # the main thread may be stuck in C++ inside a collective: no clean unwinding


class Watchdog:
    def __init__(self, rank: int, world_size: int, timeout: float, host: str, port: int,
                 failures: FailureLog | None = None) -> None:
        self.rank, self.world, self.timeout = rank, world_size, timeout
        self.failures = failures
        self.neighbour_host: str | None = None
        self.rank0_host: str | None = None
        self._recorded = threading.Lock()  # both threads may notice a lost rank 0: one record
        self.interval = max(0.2, min(5.0, timeout / 6))
        self.host, self.port = host, port
        self._stop = threading.Event()
        self._last_ok = time.monotonic()
        self._threads: list[threading.Thread] = []

    def start(self) -> Watchdog:
        store = tdist.TCPStore(self.host, self.port, self.world, is_master=False,
                               timeout=timedelta(seconds=max(5.0, self.timeout)), wait_for_workers=False)
        self.store = tdist.PrefixStore("megatron-watchdog", store)
        self.store.set(f"host{self.rank}", this_host())  # read only by this rank's watcher, once
        self.store.add(f"hb{self.rank}", 1)
        for target in (self._beat, self._guard):
            t = threading.Thread(target=target, name=f"watchdog-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Clean end of training: tell the watcher of this rank that silence from now on is expected."""
        if self._stop.is_set():
            return
        self._stop.set()
        with contextlib.suppress(RuntimeError, OSError):  # the store host may already be gone at the end
            self.store.add(f"done{self.rank}", 1)
        for t in self._threads:
            t.join(timeout=2 * self.interval + 1)

    def wait_for_verdict(self) -> None:
        """A dead peer usually surfaces first as a collective error in the main thread: give the watchdog
        up to its timeout to name the lost rank (it exits the process); return if no rank was lost."""
        deadline = time.monotonic() + self.timeout + 3 * self.interval
        while time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.2)

    def _beat(self) -> None:
        neighbour = (self.rank + 1) % self.world
        seen, seen_at = -1, time.monotonic()
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"hb{self.rank}", 1)
                if self.store.add("abort", 0) > 0:
                    if self._stop.is_set():
                        return
                    self._linger()
                    _die(self.store.get("verdict").decode())
                count = self.store.add(f"hb{neighbour}", 0)
                done = self.store.add(f"done{neighbour}", 0) > 0
                if self.neighbour_host is None and self.store.check([f"host{neighbour}"]):
                    self.neighbour_host = self.store.get(f"host{neighbour}").decode()
                    if neighbour == 0:  # the store dies with rank 0: its host must be known before
                        self.rank0_host = self.neighbour_host
            except (RuntimeError, OSError) as e:  # the store itself is gone: rank 0 hosted it
                if self._stop.is_set():
                    return
                self._record_rank0_lost("its rendezvous store stopped answering")
                _die(f"lost rank 0 (its rendezvous store at {self.host}:{self.port} stopped answering: "
                     f"{str(e).splitlines()[0] if str(e) else type(e).__name__}); rank {self.rank} exits")
            now = time.monotonic()
            self._last_ok = now
            if count != seen or done or neighbour == self.rank:
                seen, seen_at = count, now
                continue
            if now - seen_at > self.timeout and not self._stop.is_set():
                verdict = (f"lost rank {neighbour}: no heartbeat for {now - seen_at:.0f} s (watchdog timeout "
                           f"{self.timeout:g} s, noticed by rank {self.rank}); every rank exits")
                if self.failures is not None:
                    self.failures.write(neighbour, self.neighbour_host or "?", LOST_RANK, verdict)
                try:
                    self.store.set("verdict", verdict)
                    self.store.add("abort", 1)
                    self._linger()
                finally:
                    _die(verdict)

    def _linger(self) -> None:
        """Rank 0 hosts the store: keep it up for two more beats so every survivor can read the verdict."""
        if self.rank == 0:
            time.sleep(2 * self.interval + 0.5)

    def _record_rank0_lost(self, why: str) -> None:
        """Every survivor notices a lost rank 0; only its watcher in the ring (the last rank) records it."""
        if self.failures is not None and self.rank == self.world - 1 and self._recorded.acquire(blocking=False):
            self.failures.write(0, self.rank0_host or "?", LOST_RANK, f"lost rank 0: {why}")

    def _guard(self) -> None:
        while not self._stop.wait(self.interval):
            silent = time.monotonic() - self._last_ok
            if silent > self.timeout + 2 * self.interval and not self._stop.is_set():
                self._record_rank0_lost(f"its rendezvous store has not answered for {silent:.0f} s")
                _die(f"lost rank 0: its rendezvous store at {self.host}:{self.port} has not answered for "
                     f"{silent:.0f} s; rank {self.rank} exits")


def start_watchdog(timeout: float, failures: FailureLog | None = None) -> Watchdog | None:
    """Start on every rank after the process group exists; None when disabled or single-process. ``failures``:
    where the rank that names a lost rank records it (None: nowhere)."""
    if timeout <= 0 or not tdist.is_initialized() or tdist.get_world_size() == 1:
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return Watchdog(tdist.get_rank(), tdist.get_world_size(), timeout, host, port, failures).start()
