"""The Supervisor (megatron/resilience/supervisor.py) on one process: saves when due and at the end (never twice for one
iteration), says why it exits, marks a finished run, restores the signal handlers, and records a rank's own
failure. One rank: the flags all-reduce is the identity."""

from __future__ import annotations

import dataclasses
import signal
import time

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


def _chained(tmp_path, monkeypatch, left: float, start: int, saves: list) -> Supervisor:
    """A job of a chain (under Slurm, --save = --load) that resumes after ``start`` with ``left`` seconds to its end;
    evaluations every 2 iterations, 10 batches each, valid and test."""
    monkeypatch.setenv("SLURM_JOB_ID", str(41 + start))
    monkeypatch.setenv("SLURM_JOB_END_TIME", "4102444800")  # replaced below: the fixed clock is the end's
    run = _run(tmp_path, "--load", str(tmp_path), "--eval-interval", "2", "--eval-iters", "10",
               "--job-end-margin-secs", "5")
    supervisor = Supervisor(run, rank=0, world_size=1)
    supervisor.begin(start, lambda it, consumed, saver: saves.append(it), valid=True, test=True)
    supervisor.deadline.end.close()
    supervisor.deadline.end.value = time.time() + left
    return supervisor


def test_an_evaluation_that_does_not_fit_moves_to_the_next_job_which_runs_it_first(tmp_path, monkeypatch, one_rank,
                                                                                   capsys):
    saves = []
    job = _chained(tmp_path, monkeypatch, 30.0, 0, saves)
    job.after_step(1, 2.5)
    assert not job.decide(1, 4).exit and job.evaluation_guard("periodic", 1) is not None
    job.after_step(2, 2.5)
    goes_on = job.evaluation_guard("periodic", 2)
    assert goes_on(1.0, 5.0, 8) is False  # 40 s more, with a save and the margin, in 30 s: no
    decision = job.decide(2, 8)
    assert (decision.save, decision.exit, saves) == (True, True, [2])
    assert decision.reason.startswith("the evaluation at iteration 2 (~41 s predicted, 1 s of it done) does not fit")
    job.end(2, 8)
    job.finish(2, 8, evaluated=False)
    record = run_files.read_moved_evaluation(str(tmp_path))
    assert (record["iteration"], record["job"]) == (2, "41")
    assert run_files.read_finished(str(tmp_path)) is None
    out = capsys.readouterr().out
    assert "> the evaluation at iteration 2 (~41 s predicted, 1 s of it done) does not fit before the job's end " \
           "(30 s left, with a save and the margin): moved to the next job, which runs it first" in out
    # the next job resumes from iteration 2: the evaluation first, whole, then training
    nxt = _chained(tmp_path, monkeypatch, 3600.0, 2, saves)
    assert nxt.moved_evaluation == 2
    assert "> the evaluation at iteration 2 was moved here from job 41: it runs before the first step" in \
        capsys.readouterr().out
    assert nxt.evaluation_guard("moved", 2)(1.0, 5.0, 8) is True
    nxt.moved_evaluation_done()
    assert nxt.stopped_before_training() is None and run_files.read_moved_evaluation(str(tmp_path)) is None
    nxt.control.close()


def test_the_end_of_training_evaluation_moves_and_the_run_is_finished_after_it(tmp_path, monkeypatch, one_rank,
                                                                               capsys):
    saves = []
    job = _chained(tmp_path, monkeypatch, 30.0, 3, saves)
    job.after_step(4, 2.5)
    assert job.evaluation_guard("periodic", 4)(1.0, 0.5, 8) is True  # 4 s more: it fits
    assert not job.decide(4, 16).exit
    job.end(4, 16)
    assert saves == [4]  # the end of training is saved before its evaluation
    assert job.evaluation_guard("end", 4)(1.0, 2.0, 18) is False  # valid and test: 36 s more in 30 s
    job.finish(4, 16, evaluated=False)
    assert run_files.read_finished(str(tmp_path)) is None  # the chain goes on: the next job evaluates
    assert ("> the end-of-training evaluation (valid and test) (~37 s predicted, 1 s of it done) does not fit before "
            "the job's end (30 s left): moved to the next job; the run is marked finished after it") in \
        capsys.readouterr().out
    nxt = _chained(tmp_path, monkeypatch, 3600.0, 4, saves)
    assert nxt.moved_evaluation is None  # the periodic evaluation of 4 ran in the job before
    nxt.end(4, 16)
    assert nxt.evaluation_guard("end", 4)(1.0, 2.0, 18) is True
    nxt.finish(4, 16, evaluated=True)
    assert run_files.read_finished(str(tmp_path))["iteration"] == 4 and saves == [4]


def test_outside_slurm_evaluations_run_whole_with_no_collective_of_their_own(tmp_path, one_rank):
    supervisor = Supervisor(_run(tmp_path, "--load", str(tmp_path), "--eval-interval", "2"), rank=0, world_size=1)
    run_files.write_moved_evaluation(str(tmp_path), 2, "7")
    supervisor.begin(2, lambda it, consumed, saver: None, valid=True, test=True)
    assert supervisor.moved_evaluation is None and supervisor.evaluation_guard("periodic", 2) is None
    assert supervisor.evaluation_guard("end", 4) is None and one_rank == []
    supervisor.control.close()
