"""The Supervisor (megatron/resilience/supervisor.py) on one process: saves when due and at the end (never twice for one
iteration), says why it exits, marks a finished run, restores the signal handlers, and records a rank's own
failure. One rank: the flags all-reduce is the identity."""

from __future__ import annotations

import dataclasses
import signal

import pytest

from megatron.arguments import parse_args, run_config_from_args
from megatron.core import comm
from megatron.progress import PROGRESS
from megatron.resilience import run_files
from megatron.resilience.failure_record import DEVICE_ERROR, FILE, OUT_OF_MEMORY, read_records
from megatron.resilience.supervisor import Supervisor, tracks_collectives
from tests.models import CONFIG_GPT


@pytest.fixture
def one_rank(monkeypatch):
    sent = []
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # no Slurm job: no deadline
    monkeypatch.setattr(comm, "reduce_host", lambda values, *a, **k: sent.append(list(values)) or list(values))
    PROGRESS.restart()
    return sent


def _run(tmp_path, *flags: str):
    argv = CONFIG_GPT + ["--save", str(tmp_path), *flags]
    return run_config_from_args(parse_args(argv), 1, 200)


def _train(supervisor: Supervisor, iterations: int) -> tuple[int, list]:
    """The loop's calls, a step of 4 samples and loss 2.5 each; returns (the last iteration, the decisions)."""
    decisions, it = [], 0
    for it in range(1, iterations + 1):
        supervisor.after_step(it, 2.5)
        decisions.append(supervisor.decide(it, 4 * it))
        if decisions[-1].exit:
            break
    supervisor.end(it, 4 * it)
    supervisor.finish(it, 4 * it, evaluated=False)  # no evaluation splits: nothing to evaluate at the end
    return it, decisions


def test_saves_at_the_interval_and_the_end_once_then_marks_the_run_finished(tmp_path, one_rank):
    saves = []
    before = signal.getsignal(signal.SIGUSR1)
    supervisor = Supervisor(_run(tmp_path, "--save-interval", "2"), rank=0, world_size=1)
    supervisor.begin(0, lambda it, consumed, saver: saves.append((it, consumed, saver)))
    assert signal.getsignal(signal.SIGUSR1) != before  # run control's handler while training
    it, decisions = _train(supervisor, 4)
    assert it == 4 and [d.save for d in decisions] == [False, True, False, True] and not any(d.exit for d in decisions)
    assert saves == [(2, 8, None), (4, 16, None)]  # the last iteration was just saved: not saved again at the end
    assert run_files.read_finished(str(tmp_path))["iteration"] == 4
    assert signal.getsignal(signal.SIGUSR1) == before
    assert len(one_rank) == 4  # one flags all-reduce per iteration, nothing else
    assert supervisor.named_stragglers == {}


def test_an_exit_saves_says_why_and_leaves_the_run_unfinished(tmp_path, one_rank, capsys):
    saves = []
    supervisor = Supervisor(_run(tmp_path, "--exit-interval", "3"), rank=0, world_size=1)
    supervisor.begin(0, lambda it, consumed, saver: saves.append((it, consumed)))
    it, decisions = _train(supervisor, 4)
    assert it == 3 and (decisions[-1].save, decisions[-1].exit, decisions[-1].reason) == (True, True,
                                                                                          "--exit-interval 3")
    assert saves == [(3, 12)]
    assert "> exiting at iteration 3 after a checkpoint: --exit-interval 3" in capsys.readouterr().out
    assert run_files.read_finished(str(tmp_path)) is None


def test_the_end_of_training_is_saved_without_an_interval(tmp_path, one_rank):
    saves = []
    resumed = Supervisor(_run(tmp_path), rank=0, world_size=1)
    resumed.begin(4, lambda it, consumed, saver: saves.append(it))  # resumed at the end: nothing to train
    resumed.end(4, 16)
    assert saves == []
    supervisor = Supervisor(_run(tmp_path), rank=0, world_size=1)
    supervisor.begin(0, lambda it, consumed, saver: saves.append(it))
    _train(supervisor, 3)
    assert saves == [3]


def test_an_error_is_recorded_for_the_next_job(tmp_path, one_rank):
    supervisor = Supervisor(_run(tmp_path), rank=0, world_size=1)
    supervisor.start()  # one process: no watchdog
    assert supervisor.watchdog is None
    supervisor.on_error(MemoryError("can't allocate memory"))
    supervisor.on_error(RuntimeError("HIP error: uncorrectable ECC error encountered"))
    supervisor.on_error(ValueError("a bug of ours"))  # says nothing about the host: no record
    supervisor.stop()
    assert [(r.rank, r.cause) for r in read_records(str(tmp_path / FILE))] == [(0, OUT_OF_MEMORY), (0, DEVICE_ERROR)]


def test_collectives_are_tracked_only_for_a_reader(tmp_path):
    rt = _run(tmp_path).runtime
    assert tracks_collectives(rt)
    quiet = dataclasses.replace(rt, watchdog_timeout_secs=0, straggler_interval=0)
    assert not tracks_collectives(quiet)
