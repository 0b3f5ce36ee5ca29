"""The watchdog's store protocol with three in-process "ranks" (threads and their own progress records) on a real
TCPStore: three store operations per rank per beat in normal running, then a census and one verdict naming the rank
that stopped moving, its stack file (without --save: in the temporary folder the line names, never the working
directory) and its failure record, when no rank moves for --hang-timeout."""

import glob
import json
import os
import re
import tempfile
import threading
import time
from datetime import timedelta

import torch.distributed as tdist

from megatron.progress import Identity, Progress
from megatron.resilience import watchdog as wd
from megatron.resilience.failure_record import FailureLog
from tests.launch import free_port


class CountingStore:
    def __init__(self, store):
        self.store, self.ops = store, 0

    def __getattr__(self, name):
        fn = getattr(self.store, name)

        def call(*args, **kwargs):
            self.ops += 1
            return fn(*args, **kwargs)

        return call


class Ranks:
    """``world`` in-process ranks: a progress record and a watchdog each, on one real TCPStore; ``died`` collects the
    line each watchdog thread would exit the process with (that rank's watchdog stops instead)."""

    def __init__(self, world: int, tmp_path, timeout: float = 30.0, hang_timeout: float = 1.0,
                 run_folder: str | None = None) -> None:
        port = free_port()
        self.master = tdist.TCPStore("127.0.0.1", port, world, True, timeout=timedelta(seconds=10),
                                     wait_for_workers=False)
        self.died: dict[str, str] = {}
        self.dogs, self.progress = [], []
        for r in range(world):
            p = Progress()
            p.identity = Identity(r, f"node{r}", str(r))
            p.start_iteration(7)  # past the warm-up: the normal allowance applies
            p.first_iteration = 1
            self.progress.append(p)
            settings = wd.WatchdogSettings(timeout, hang_timeout, 100.0, 100.0, 60.0, run_folder,
                                           FailureLog.in_folder(str(tmp_path)))
            self.dogs.append(wd.Watchdog(r, world, settings, "127.0.0.1", port, progress=p, die=self.died_with))

    def died_with(self, msg: str) -> None:
        name = threading.current_thread().name
        self.died[name] = msg
        self.dogs[int(name.rsplit("-", 1)[1])]._stop.set()

    def wait(self, count: int, seconds: float = 40) -> None:  # ~3 s on an idle machine
        deadline = time.monotonic() + seconds
        while len(self.died) < count and time.monotonic() < deadline:
            time.sleep(0.1)

    def stop(self) -> None:
        """Every watchdog thread stopped (each only collected its line: the real ``die`` would end pytest)."""
        for d in self.dogs:
            d._stop.set()
        for d in self.dogs:
            for t in d._threads:
                t.join(timeout=10)


def test_beats_stay_o1_then_one_verdict_names_the_still_rank(tmp_path, monkeypatch):
    world = 3
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # no --save: the stacks go here
    (tmp_path / "tmp").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    ranks = Ranks(world, tmp_path)
    dogs, progress, died = ranks.dogs, ranks.progress, ranks.died
    try:
        for d in dogs:
            d.start()
            d.store = CountingStore(d.store)
        assert dogs[0].interval == 0.2
        began = time.monotonic()
        while time.monotonic() - began < 2.0:  # normal running: every rank moves, every rank beats
            for p in progress:
                p.enter("forward")
            time.sleep(0.05)
        beats = (time.monotonic() - began) / dogs[0].interval
        for d in dogs:
            # 3 per beat, plus rank 0's host looked up once by its watcher (rank 2): O(1), not O(world)
            assert d.store.ops <= 3 * (beats + 1) + 2, (d.rank, d.store.ops, beats)
        # Ranks 0 and 2 wait in the world's all-reduce #4; rank 1 never reached it (still in data).
        for r in (0, 2):
            for _ in range(4):
                progress[r].enter_collective("all_reduce", "0")
        for _ in range(3):
            before = progress[1].enter_collective("all_reduce", "0")
            progress[1].leave_collective(before)
        progress[1].enter("data")
        ranks.wait(world)
    finally:
        ranks.stop()
    lines = {name: msg for name, msg in died.items() if name.startswith("watchdog_beat")}
    assert len(lines) == world, died  # the beat threads, not the guards (the store never went silent)
    line = lines["watchdog_beat-0"]
    assert set(lines.values()) == {line}
    assert line.startswith("rank 1 (host node1, GCD 1) is stuck in data for "), line
    assert "2 ranks wait for it, e.g. rank 0 in all_reduce #4 of the world group during forward" in line
    assert line.endswith("every rank exits")
    named = re.search(r"Python stacks in (\S+) on each rank's host \(no --save\)", line)
    assert named and os.path.dirname(named.group(1)) == str(tmp_path / "tmp"), line
    assert os.listdir(tmp_path / "cwd") == []  # never the working directory
    stacks = glob.glob(os.path.join(named.group(1), "rank1.txt"))
    text = open(stacks[0]).read() if stacks else ""
    assert "test_watchdog_protocol.py" in text and text.count("Thread 0x") >= 3, text  # every thread's stack
    records = [json.loads(x) for x in open(tmp_path / "failures.jsonl")]
    assert [(r["rank"], r["host"], r["cause"]) for r in records] == [(1, "node1", "stuck_rank")]


def test_out_of_memory_on_one_rank_ends_the_others_with_its_line(tmp_path):
    ranks = Ranks(2, tmp_path, timeout=6.0, hang_timeout=0)  # no hang verdict may come first
    try:
        for d in ranks.dogs:
            d.start()
        ranks.progress[1].enter("backward")
        ranks.dogs[1].on_error(RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate "
                                            "memory: you tried to allocate 4096 bytes"))
        ranks.wait(1)
        time.sleep(3 * ranks.dogs[0].interval)  # rank 1 must not exit through its own request
    finally:
        ranks.stop()
    assert list(ranks.died) == ["watchdog_beat-0"], ranks.died
    assert re.fullmatch(r"rank 1 \(host node1, GCD 1\) ran out of host memory in backward at iteration 7: \[enforce "
                        r"fail .*; every rank exits", ranks.died["watchdog_beat-0"]), ranks.died


def test_allowances_and_the_automatic_hang_timeout():
    p = Progress()
    settings = wd.WatchdogSettings(60.0, None, 900.0, 700.0, 600.0, "/tmp")
    dog = wd.Watchdog(0, 75_000, settings, "127.0.0.1", 1, progress=p)
    assert dog.interval == 11.25  # 3 store operations x 75,000 ranks per beat <= 20,000 per second
    assert dog.allowance("setup", 0) == 700.0 and dog.allowance("load", 0) == 700.0
    p.start_iteration(41)  # a resumed job: its first two iterations are the warm-up
    p.end_step()
    assert dog.allowance("forward", 42) == 700.0 and dog.allowance("save", 43) == 900.0
    assert dog.allowance("forward", 43) == 30.0  # a fast step: the 30 s floor
    p.step_seconds.extend([20.0, 9.0])
    assert dog.allowance("backward", 50) == 100.0  # 5 x the slowest recent step
    p.step_seconds.append(200.0)
    assert dog.hang_timeout() == 480.0  # capped at 0.8 x the collective timeout
    dog.s.hang_timeout = 45.0
    assert dog.allowance("backward", 50) == 45.0 and wd.beat_interval(60.0, 3.0, 4) == 0.5
