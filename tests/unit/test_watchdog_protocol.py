"""The watchdog's store protocol with three in-process "ranks" (threads and their own progress records) on a real
TCPStore: three store operations per rank per beat in normal running, then a census and one verdict naming the rank
that stopped moving, its stack file and its failure record, when no rank moves for --hang-timeout."""

import glob
import json
import threading
import time
from datetime import timedelta

import torch.distributed as tdist

from megatron.progress import Identity, Progress
from megatron.training import watchdog as wd
from megatron.training.failure_record import FailureLog
from tests.launcher import free_port


class CountingStore:
    def __init__(self, store):
        self.store, self.ops = store, 0

    def __getattr__(self, name):
        fn = getattr(self.store, name)

        def call(*args, **kwargs):
            self.ops += 1
            return fn(*args, **kwargs)

        return call


def test_beats_stay_o1_then_one_verdict_names_the_still_rank(tmp_path, monkeypatch):
    world, port = 3, free_port()
    master = tdist.TCPStore("127.0.0.1", port, world, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    died: dict[str, str] = {}

    def die(msg):  # the real one exits the process: here the "rank"'s watchdog stops instead
        name = threading.current_thread().name
        died[name] = msg
        dogs[int(name.rsplit("-", 1)[1])]._stop.set()

    monkeypatch.setattr(wd, "_die", die)
    dogs, progress = [], []
    for r in range(world):
        p = Progress()
        p.identity = Identity(r, f"node{r}", str(r))
        p.start_iteration(7)  # past the warm-up: the normal allowance applies
        p.first_iteration = 1
        progress.append(p)
        settings = wd.WatchdogSettings(30.0, 1.0, 100.0, 100.0, 60.0, str(tmp_path),
                                       FailureLog.in_folder(str(tmp_path)))
        dogs.append(wd.Watchdog(r, world, settings, "127.0.0.1", port, progress=p))
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
        deadline = time.monotonic() + 40  # ~3 s on an idle machine
        while len(died) < world and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for d in dogs:
            d._stop.set()
    lines = {name: msg for name, msg in died.items() if name.startswith("watchdog_beat")}
    assert len(lines) == world, died  # the beat threads, not the guards (the store never went silent)
    line = lines["watchdog_beat-0"]
    assert set(lines.values()) == {line}
    assert line.startswith("rank 1 (host node1, GCD 1) is stuck in data for "), line
    assert "2 ranks wait for it, e.g. rank 0 in all_reduce #4 of the world group during forward" in line
    assert line.endswith("every rank exits")
    stacks = glob.glob(str(tmp_path / "hang-*" / "rank1.txt"))
    text = open(stacks[0]).read() if stacks else ""
    assert "test_watchdog_protocol.py" in text and text.count("Thread 0x") >= 3, text  # every thread's stack
    records = [json.loads(x) for x in open(tmp_path / "failures.jsonl")]
    assert [(r["rank"], r["host"], r["cause"]) for r in records] == [(1, "node1", "stuck_rank")]
    del master
