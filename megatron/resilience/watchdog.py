"""The watchdog: a rank that dies, or that is alive but stuck, ends the job within seconds of its timeout with one line
naming it (rank, host, GCD, phase), instead of every rank waiting out a collective that names nobody.

Gloo (and RCCL) collectives may wait forever on a dead or stuck peer, so nothing here uses them: each rank runs daemon
threads with their own client of the job's rendezvous TCPStore (rank 0's ``MASTER_ADDR:MASTER_PORT``). Each beat a
rank makes three store operations: it bumps its own counter, reads its ring neighbour's (rank r watches r+1) and polls
one shared ``alarm`` counter, so rank 0's store sees O(1) operations per rank per beat (the beat slows down for large
jobs: ``beat_interval``).

* Dead: a neighbour whose counter stops for ``timeout`` is lost; rank 0's store going silent means rank 0 is.
* Stuck: each rank checks locally that its main thread moves (megatron/progress.py: phase, collective). A rank still
  for longer than its allowance (--hang-timeout; saves and start-up have their own) adds itself to a ``stalled``
  counter once; when that counter reaches the world size, no rank has moved for the allowance: every rank publishes
  its position once, rank 0 computes the verdict (megatron/resilience/hang_verdict.py), the culprits, a few ranks
  waiting on them and rank 0 write their Python stacks (all threads) to the run folder (--save; else the temporary
  folder, never the working directory), and every rank exits
  non-zero with the verdict's line. A collective that fails first (its timeout, a lost peer) asks for the same
  census at once, so the verdict still names the rank that never arrived.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as tdist

from megatron.config.runtime import RuntimeConfig
from megatron.progress import LONG_PHASES, PROGRESS, STARTUP_PHASES, Progress, describe_out_of_memory, is_out_of_memory
from megatron.resilience.failure_record import LOST_RANK, FailureLog
from megatron.resilience.hang_verdict import Verdict, judge

EXIT_CODE = 3
DONE = 1 << 40
"""Added to a rank's heartbeat counter when it stops cleanly: its watcher reads "finished", not "silent"."""
STORE_OPS_BUDGET = 20_000
"""Beat operations per second rank 0's store should see at most: the beat slows down above ~6,700 ranks."""
OPS_PER_BEAT = 3
WARMUP_ITERS = 2
"""The first iterations of a job (compile, allocator warm-up, communicator set-up) get the start-up allowance."""
AUTO_FACTOR, AUTO_MIN_S, AUTO_CAP = 5.0, 30.0, 0.8
"""Automatic --hang-timeout: 5 x the slowest of the last steps, at least 30 s, at most 0.8 x the collective timeout."""


def exit_every_rank(msg: str) -> None:
    """The line (a verdict, a lost rank) on stderr, then this process exits: every rank does the same."""
    sys.stderr.write(f"error: {msg}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(EXIT_CODE)  # the main thread may be stuck in C++ inside a collective: no clean unwinding


@dataclass
class WatchdogSettings:
    timeout: float
    """Dead rank: no heartbeat for this long (--watchdog-timeout-secs)."""
    hang_timeout: float | None
    """None: automatic; 0: no hang detection."""
    save_allowance: float
    startup_allowance: float
    collective_timeout: float
    run_folder: str | None
    """Where the stack files go: --save; None: rank 0's temporary folder (tempfile.gettempdir(), on each rank's host),
    never the working directory (a checkout, Slurm's submit directory)."""
    failures: FailureLog | None = None
    """The run's failure record (--save's failures.jsonl; None without --save)."""

    @classmethod
    def from_runtime(cls, rt: RuntimeConfig, save: str | None, failures: FailureLog | None) -> WatchdogSettings:
        """``save``: --save (the run folder); ``failures``: its failure record."""
        collective = rt.collective_timeout_s
        return cls(rt.watchdog_timeout_secs, rt.hang_timeout, rt.hang_timeout_save or collective,
                   rt.hang_timeout_startup or collective, collective, save, failures)


def beat_interval(timeout: float, hang_timeout: float | None, world: int) -> float:
    """A sixth of the shorter timeout (0.2-5 s), but slow enough that rank 0's store gets at most STORE_OPS_BUDGET
    beat operations per second (75,000 ranks: 11.25 s)."""
    shortest = min(timeout, hang_timeout if hang_timeout else AUTO_MIN_S)
    return max(0.2, min(5.0, shortest / 6), OPS_PER_BEAT * world / STORE_OPS_BUDGET)


class Watchdog:
    def __init__(self, rank: int, world_size: int, settings: WatchdogSettings, host: str, port: int,
                 progress: Progress = PROGRESS, die: Callable[[str], None] = exit_every_rank) -> None:
        """``die``: what a verdict does with its line (the process exits; a test of the protocol in one process
        collects the lines instead)."""
        self.rank, self.world, self.s = rank, world_size, settings
        self.die = die
        self.timeout = settings.timeout
        self.progress = progress
        self.interval = beat_interval(settings.timeout, settings.hang_timeout, world_size)
        self.census_wait = 3 * self.interval + 5.0
        self.host, self.port = host, port
        self.failures = settings.failures
        self._stop = threading.Event()
        self._last_ok = time.monotonic()
        self._threads: list[threading.Thread] = []
        self._seen_alarm = 0
        self._stalled = False
        self._published: set[int] = set()
        self._judging = False
        self._own_verdict = False
        self._rank0_host = "?"
        self._recorded: set[tuple[int, str]] = set()
        self._recorded_lock = threading.Lock()

    # --- life cycle (main thread) ---------------------------------------------------------------------------------

    def start(self) -> Watchdog:
        store = tdist.TCPStore(self.host, self.port, self.world, is_master=False,
                               timeout=timedelta(seconds=max(5.0, self.timeout)), wait_for_workers=False)
        self.store = tdist.PrefixStore("megatron-watchdog", store)
        ident = self.progress.identity
        self.store.set(f"where{self.rank}", json.dumps([ident.host, ident.gcd]))  # read only when naming this rank
        self.store.add(f"hb{self.rank}", 1)
        for target in (self._beat, self._guard):
            t = threading.Thread(target=target, name=f"watchdog{target.__name__}-{self.rank}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, clean: bool = True) -> None:
        """End of training. ``clean``: this rank's silence from now on is expected (it counts as finished, and as
        not moving); after an error it is not, so the others name this rank if they end up waiting for it."""
        if self._stop.is_set():
            return
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2 * self.interval + 1)
        if not clean:
            return
        with contextlib.suppress(RuntimeError, OSError):  # the store host may already be gone at the end
            self.store.add(f"hb{self.rank}", DONE)
            if self.s.hang_timeout != 0 and not self._stalled:
                self.store.add("stalled", 1)

    def on_error(self, error: BaseException) -> None:
        """The main thread's training raised. Out of memory: tell every rank (they exit with its line; this rank's
        own line comes from errors.run_cli). A collective that failed: census now, and wait for the verdict (the
        watchdog thread exits the process); returns if none comes."""
        if self._stop.is_set():
            return
        if is_out_of_memory(error):  # (the supervisor records it in the failure record)
            line = describe_out_of_memory(error, self.progress)
            self._own_verdict = True
            with contextlib.suppress(RuntimeError, OSError):
                if self.store.add("out_of_memory", 1) == 1:  # the first rank out of memory speaks for all
                    self._request({"kind": "verdict", "line": f"{line}; every rank exits", "dump": []})
            return
        text = str(error)
        # Gloo names a lost peer in a plain RuntimeError from places the progress record does not see.
        if self.progress.position.failed is None and not (isinstance(error, tdist.DistError) or "peer" in text
                                                          or "remote worker" in text):
            return
        self._request_census(f"collective error on rank {self.rank}")
        deadline = time.monotonic() + self.census_wait + 3 * self.interval + 5.0
        while time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.2)

    # --- threads --------------------------------------------------------------------------------------------------

    def _beat(self) -> None:
        neighbour = (self.rank + 1) % self.world
        seen, seen_at = -1, time.monotonic()
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"hb{self.rank}", 1)
                alarm = self.store.add("alarm", 0)
                count = self.store.add(f"hb{neighbour}", 0)
                if alarm > self._seen_alarm:
                    self._on_alarm(alarm)
                self._check_stall()
                if self._rank0_host == "?" and self.rank == self.world - 1:  # known before the store dies with it
                    self._rank0_host = self._where(0)[0]
            except (RuntimeError, OSError) as e:  # the store itself is gone: rank 0 hosted it
                if self._stop.is_set():
                    return
                if self.rank == self.world - 1:  # rank 0's watcher in the ring records it
                    self._record(0, self._rank0_host, LOST_RANK, "lost rank 0: its rendezvous store stopped answering")
                self.die(f"lost rank 0 (its rendezvous store at {self.host}:{self.port} stopped answering: "
                     f"{str(e).splitlines()[0] if str(e) else type(e).__name__}); rank {self.rank} exits")
            now = time.monotonic()
            self._last_ok = now
            if count != seen or count >= DONE or neighbour == self.rank:
                seen, seen_at = count, now
                continue
            if now - seen_at > self.timeout and not self._stop.is_set():
                self._lost_neighbour(neighbour, now - seen_at)

    def _guard(self) -> None:
        while not self._stop.wait(self.interval):
            silent = time.monotonic() - self._last_ok
            if silent > self.timeout + 2 * self.interval and not self._stop.is_set():
                line = (f"lost rank 0: its rendezvous store at {self.host}:{self.port} has not answered for "
                        f"{silent:.0f} s; rank {self.rank} exits")
                if self.rank == self.world - 1:  # rank 0's watcher in the ring records it
                    self._record(0, self._rank0_host, LOST_RANK, line)
                self.die(line)

    # --- dead ranks -----------------------------------------------------------------------------------------------

    def _where(self, rank: int) -> tuple[str, str]:
        with contextlib.suppress(RuntimeError, OSError, ValueError):
            if self.store.check([f"where{rank}"]):
                host, gcd = json.loads(self.store.get(f"where{rank}"))
                return host, gcd
        return "?", "?"

    def _lost_neighbour(self, neighbour: int, silent: float) -> None:
        host, gcd = self._where(neighbour)
        line = (f"lost rank {neighbour} (host {host}, GCD {gcd}): no heartbeat for {silent:.0f} s (watchdog timeout "
                f"{self.timeout:g} s, noticed by rank {self.rank}); every rank exits")
        self._record(neighbour, host, LOST_RANK, line)
        try:
            self._request({"kind": "verdict", "line": line, "dump": []})
            self._linger()
        finally:
            self.die(line)

    # --- stuck ranks ----------------------------------------------------------------------------------------------

    def hang_timeout(self) -> float:
        """The allowance of a normal step: --hang-timeout, or 5 x the slowest recent step within [30 s, 0.8 x the
        collective timeout]."""
        if self.s.hang_timeout:
            return self.s.hang_timeout
        slowest = max(self.progress.step_seconds, default=0.0)
        return min(max(AUTO_MIN_S, AUTO_FACTOR * slowest), AUTO_CAP * self.s.collective_timeout)

    def allowance(self, phase: str, iteration: int) -> float:
        if phase in LONG_PHASES:
            return self.s.save_allowance
        first = self.progress.first_iteration
        if phase in STARTUP_PHASES or first is None or iteration < first + WARMUP_ITERS:
            return self.s.startup_allowance
        return self.hang_timeout()

    def _check_stall(self) -> None:
        if self.s.hang_timeout == 0:
            return
        pos = self.progress.position
        stalled = time.monotonic() - pos.since > self.allowance(pos.phase, pos.iteration)
        if stalled == self._stalled:
            return
        self._stalled = stalled
        if self.store.add("stalled", 1 if stalled else -1) >= self.world and stalled:
            self._request_census("no rank moved")

    def _request(self, req: dict) -> None:
        n = self.store.add("alarm", 1)
        self.store.set(f"req{n}", json.dumps(dict(req, sender=self.rank)))

    def _request_census(self, why: str) -> None:
        with contextlib.suppress(RuntimeError, OSError):
            if self.store.add("census_open", 1) == 1:  # one census at a time
                self._request({"kind": "census", "why": why})

    def _on_alarm(self, alarm: int) -> None:
        for n in range(self._seen_alarm + 1, alarm + 1):
            req = json.loads(self.store.get(f"req{n}"))
            self._seen_alarm = n
            if req["kind"] == "census":
                self._publish(n)
                if self.rank == 0 and not self._judging:
                    self._judging = True
                    threading.Thread(target=self._judge, args=(n, req["why"]), name="watchdog-judge",
                                     daemon=True).start()
            elif req["kind"] == "verdict":
                if req["sender"] == self.rank and self._own_verdict:
                    continue  # this rank's main thread prints its own error and exits
                if self.rank in req["dump"]:
                    self._dump_stacks(req["stacks"], req["line"])
                self._linger()
                self.die(req["line"])

    def _snapshot(self) -> dict:
        p, ident = self.progress.position, self.progress.identity
        age = time.monotonic() - p.since
        return {"it": p.iteration, "ph": p.phase, "age": round(age, 1),
                "stalled": age > self.allowance(p.phase, p.iteration), "coll": p.collective, "err": p.failed,
                "n": dict(self.progress.counts), "host": ident.host, "gcd": ident.gcd}

    def _publish(self, n: int) -> None:
        if n in self._published:
            return
        self._published.add(n)
        self.store.set(f"pos{n}/{self.rank}", json.dumps(self._snapshot()))
        self.store.add(f"pub{n}", 1)

    def _judge(self, n: int, why: str) -> None:
        """Rank 0: wait for every position (or the census deadline), then publish the verdict, or call the census off
        when a rank moved after all (a slow step, not a hang)."""
        try:
            deadline = time.monotonic() + self.census_wait
            while self.store.add(f"pub{n}", 0) < self.world and time.monotonic() < deadline:
                time.sleep(0.05)
            positions, missing = self._gather(n)
            failed = any(p.get("err") for p in positions.values())
            if not missing and not failed and not all(p["stalled"] for p in positions.values()):
                self.store.set("census_open", "0")
                return
            stacks = os.path.join(self.s.run_folder or tempfile.gettempdir(), "hang-" + time.strftime("%Y%m%d-%H%M%S")
                                  + (f"-job{os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID") else ""))
            named = stacks if self.s.run_folder else f"{stacks} on each rank's host (no --save)"
            verdict = judge(positions, self.world, missing, {r: self._where(r) for r in missing}, self.census_wait,
                            named)
            self._publish_verdict(verdict, stacks)
        except (RuntimeError, OSError):
            pass  # the store is going away: the job is ending anyway
        finally:
            self._judging = False

    def _gather(self, n: int) -> tuple[dict[int, dict], list[int]]:
        positions, missing = {}, []
        chunk = 1024
        for lo in range(0, self.world, chunk):
            keys = [f"pos{n}/{r}" for r in range(lo, min(self.world, lo + chunk))]
            if self.store.check(keys):
                values = self.store.multi_get(keys)
            else:
                values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
            for r, v in zip(range(lo, lo + len(keys)), values, strict=True):
                if v is not None:
                    positions[r] = json.loads(v)
                elif self.store.add(f"hb{r}", 0) < DONE:  # a rank that finished cleanly is no culprit
                    missing.append(r)
        return positions, missing

    def _publish_verdict(self, verdict: Verdict, stacks: str) -> None:
        for rank, host, cause in verdict.records:
            self._record(rank, host, cause, verdict.line)
        self._request({"kind": "verdict", "line": verdict.line, "dump": verdict.dump, "stacks": stacks})

    # --- on the way out -------------------------------------------------------------------------------------------

    def _dump_stacks(self, folder: str, line: str) -> None:
        """Every thread's Python stack (the main thread shows where it is stuck) in FOLDER/rankN.txt."""
        with contextlib.suppress(OSError):
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"rank{self.rank}.txt"), "w") as f:
                p = self.progress.position
                f.write(f"# {self.progress.identity}: {self.progress.where()} for "
                        f"{time.monotonic() - p.since:.1f} s at iteration {p.iteration}\n# verdict: {line}\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)

    def _record(self, rank: int, host: str, cause: str, detail: str) -> None:
        """One failure record per event, written by the one rank that knows it (the judge, the watcher of a lost
        rank, the rank out of memory); both of this rank's threads may notice a lost rank 0: recorded once."""
        with self._recorded_lock:
            if self.failures is None or (rank, cause) in self._recorded:
                return
            self._recorded.add((rank, cause))
        self.failures.write(rank, host, cause, detail)

    def _linger(self) -> None:
        """Rank 0 hosts the store: keep it up for two more beats so every survivor can read the verdict."""
        if self.rank == 0:
            time.sleep(2 * self.interval + 0.5)


def start_watchdog(settings: WatchdogSettings) -> Watchdog | None:
    """Start on every rank after the process group exists; None when disabled or single-process."""
    if settings.timeout <= 0 or not tdist.is_initialized() or tdist.get_world_size() == 1:
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return Watchdog(tdist.get_rank(), tdist.get_world_size(), settings, host, port).start()
