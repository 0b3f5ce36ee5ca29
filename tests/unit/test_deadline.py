"""megatron/resilience/deadline.py on one process with a fake clock: when rank 0 says "stop now", what it predicts
a save costs, what it logs, and that its verdict rides the one flags all-reduce of RunControl (no collective of
its own). Also the small run files (finished marker, save-time record) and the failure records."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from megatron.arguments import parse_args, run_config_from_args
from megatron.core import comm
from megatron.progress import this_host
from megatron.resilience import deadline as dl
from megatron.resilience import failure_record as fr
from megatron.resilience import run_files
from megatron.resilience.eval_budget import GO, MOVE, STOP_AFTER
from tests.models import GPT_H64

END = 10_000.0


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _end(value=END):
    return SimpleNamespace(value=value, source="SLURM_JOB_END_TIME", close=lambda: None)


def _deadline(tmp_path, clock, save_secs=10.0, margin=None, lead=None, lines=None):
    settings = dl.DeadlineSettings(job_id="77", end_time=END, margin_secs=margin, save_dir=str(tmp_path),
                                   signal_lead_secs=lead)
    lines = [] if lines is None else lines
    return dl.Deadline(settings, _end(), dl.SavePrediction(save_secs, "estimated"), clock=clock,
                       say=lines.append), lines


def test_stops_when_the_next_step_a_save_and_the_margin_no_longer_fit(tmp_path):
    clock = Clock(END - 100)
    d, lines = _deadline(tmp_path, clock)
    d.begin()
    stops = []
    for _ in range(100):
        clock.t += 2.0  # a 2 s step
        stops.append((clock.t, d.should_stop()))
        if stops[-1][1]:
            break
    assert stops[-1][1], "never stopped"
    t = stops[-1][0]
    # margin = max(2 x 2 s, 20% of 10 s, 15 s) = 15 s: the last step that is allowed ends where 2 + 10 + 15 fit
    assert t + 2 + 10 + 15 > END >= t - 2 + 2 + 10 + 15
    assert d.margin() == 15.0
    assert "the next step (2.0 s), a save (10.0 s) and the margin (15.0 s) would not fit" in d.reason
    start, = [line for line in lines if "ends at" in line]  # said once, after the first step
    assert "predicted save 10.0 s (estimated); margin 15.0 s; this job will do about 36 more iterations" in start


def test_default_margin_and_the_flag():
    d = SimpleNamespace(settings=SimpleNamespace(margin_secs=None), save_secs=200.0, step=lambda: 12.0)
    assert dl.Deadline.margin(d) == 40.0  # 20% of the save
    d.save_secs = 10.0
    assert dl.Deadline.margin(d) == 24.0  # 2 steps
    d.settings.margin_secs = 3.0
    assert dl.Deadline.margin(d) == 3.0  # --job-end-margin-secs


def test_the_largest_recent_step_counts_and_saves_are_no_steps(tmp_path):
    clock = Clock(0.0)
    d, _ = _deadline(tmp_path, clock)
    d.begin()
    for step in (1.0, 5.0, 1.0):
        clock.t += step
        d.should_stop()
    assert d.step() == 5.0  # an evaluation or a slow step is not averaged away
    clock.t += 30.0  # a save
    d.saved(30.0, 3)
    clock.t += 1.0
    d.should_stop()
    assert max(d.steps) == 5.0  # the save's 30 s did not enter the step window
    for _ in range(dl.STEP_WINDOW):
        clock.t += 1.0
        d.should_stop()
    assert d.step() == 1.0


def test_a_measured_save_is_the_next_prediction_in_this_job_and_the_next(tmp_path):
    clock = Clock(100.0)
    d, lines = _deadline(tmp_path, clock, save_secs=1.0)
    d.begin()
    clock.t += 0.5
    d.should_stop()
    d.saved(8.2, 40)
    assert d.save_secs == 8.2 and lines[-1] == "> checkpoint save took 8.2 s (predicted 1.0 s)"
    kept = run_files.read_save_time(str(tmp_path))
    assert kept["save_secs"] == 8.2 and kept["job"] == "77" and kept["iteration"] == 40 and kept["step_secs"] == 0.5
    nxt = dl.predict_save(dl.DeadlineSettings(job_id="78", save_dir=str(tmp_path)), 10**9,
                          rate=lambda *a: pytest.fail("no probe once a save was measured"))
    assert (nxt.secs, nxt.source) == (8.2, "measured by job 77")
    d2, lines2 = _deadline(tmp_path, clock, save_secs=nxt.secs)
    assert d2.previous_step == 0.5  # the start line's iteration count uses the last job's step


def test_before_any_save_the_prediction_is_bytes_over_a_probed_rate(tmp_path):
    settings = dl.DeadlineSettings(job_id="1", save_dir=str(tmp_path / "not-yet" / "ckpt"))
    probed = []
    got = dl.predict_save(settings, 4 * 10**9, rate=lambda folder, n: probed.append((folder, n)) or 2e9)
    assert got.secs == 2.0 and "4 GB per rank at 2 GB/s" in got.source
    assert probed == [(settings.save_dir, dl.PROBE_MAX_BYTES)]
    rate = dl.write_rate(str(tmp_path / "not-yet" / "ckpt"), 2**20)  # probes the nearest existing folder
    assert rate and rate > 0 and list(tmp_path.iterdir()) == []  # and leaves nothing behind
    assert dl.predict_save(dl.DeadlineSettings(job_id="1"), 10**9).source == "nothing to save (no --save)"


def test_bytes_per_writer_splits_weights_over_tp_pp_and_optimizer_over_all():
    args = parse_args(GPT_H64.flags() + ["--max-position-embeddings", "32", "--micro-batch-size", "1",
                                         "--global-batch-size", "8", "--vocab-size", "256", "--bf16",
                                         "--tensor-model-parallel-size", "2", "--zero-stage", "1", "--lr", "1e-3",
                                         "--train-iters", "10"])
    run = run_config_from_args(args, 8, 256)
    from megatron.checkpointing.live.space import checkpoint_bytes

    weights, total = checkpoint_bytes(run, False), checkpoint_bytes(run, True)
    assert dl.bytes_per_writer(run, 8, True) == pytest.approx(weights / 2 + (total - weights) / 8, abs=1)
    assert dl.bytes_per_writer(run, 8, False) == pytest.approx(weights / 2, abs=1)


def test_the_signal_lead_warning(tmp_path):
    _, lines = _deadline(tmp_path, Clock(), save_secs=400.0, lead=300.0)
    assert lines == ["> warning: the predicted checkpoint save (400 s, estimated) is longer than the job's signal "
                     "lead (300 s): a signal alone leaves no time to save; ask for #SBATCH --signal=B:USR1@510"]
    _, quiet = _deadline(tmp_path, Clock(), save_secs=200.0, lead=300.0)
    assert quiet == []


TINY = GPT_H64.flags() + ["--lr", "1e-3", "--train-iters", "10"]


def test_settings_from_flags_and_the_job_environment():
    run = run_config_from_args(parse_args(TINY + ["--job-end-margin-secs", "30", "--save", "/s", "--no-save-optim"]),
                               1, 256)
    s = dl.DeadlineSettings.from_run(run, {"SLURM_JOB_ID": "9", "SLURM_JOB_END_TIME": "1764150000",
                                           "MEGATRON_SIGNAL_LEAD_SECS": "300"})
    assert (s.job_id, s.end_time, s.margin_secs, s.save_dir, s.save_optimizer, s.signal_lead_secs) == (
        "9", 1764150000.0, 30.0, "/s", False, 300.0)
    assert dl.DeadlineSettings.from_run(run_config_from_args(parse_args(TINY), 1, 256), {}).job_id is None
    with pytest.raises(Exception, match="--job-end-margin-secs"):
        parse_args(["--job-end-margin-secs", "-1"])


def test_squeue_end_time(monkeypatch):
    outs = iter(["2026-11-26T14:00:05\n", "N/A\n", ""])
    monkeypatch.setattr(dl.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout=next(outs)))
    want = time.mktime(time.strptime("2026-11-26T14:00:05", "%Y-%m-%dT%H:%M:%S"))
    assert dl.squeue_end_time("5") == want
    assert dl.squeue_end_time("5") is None and dl.squeue_end_time("5") is None

    def missing(*a, **k):
        raise FileNotFoundError("squeue")

    monkeypatch.setattr(dl.subprocess, "run", missing)
    assert dl.squeue_end_time("5") is None


def test_the_end_time_is_read_again_in_the_background(capsys):
    answers = [2000.0]

    def squeue(job: str) -> float:
        return answers.pop(0) if answers else 2600.0

    settings = dl.DeadlineSettings(job_id="5", reread_secs=0.05)  # no SLURM_JOB_END_TIME: squeue at start
    end = dl.EndTime(settings, query=squeue)
    try:
        assert end.source == "squeue" and end.value in (2000.0, 2600.0)
        deadline = time.monotonic() + 10
        while end.value != 2600.0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert end.value == 2600.0  # scontrol update TimeLimit= moved the end
        assert "> job 5's end moved to" in capsys.readouterr().out
    finally:
        end.close()


def test_no_deadline_outside_slurm_or_off_rank_0(capsys, monkeypatch):
    run = SimpleNamespace()
    assert dl.start_deadline(dl.DeadlineSettings(job_id=None), run, 2, 0) is None
    assert dl.start_deadline(dl.DeadlineSettings(job_id="5", end_time=END), run, 2, 1) is None
    monkeypatch.setattr(dl, "squeue_end_time", lambda job: None)
    assert dl.start_deadline(dl.DeadlineSettings(job_id="5"), run, 2, 0) is None
    assert capsys.readouterr().out.count("end time unknown") == 1


def test_the_verdict_rides_the_one_flags_all_reduce(monkeypatch, tmp_path):
    """Rank 0's deadline adds one value to RunControl's reduce_host (MAX); there is no other collective. A rank
    without a deadline contributes 0 and follows the agreed flag."""
    from megatron.resilience.control import RunControl

    sent = []
    peer = {"ending": 0.0}

    def reduce_host(values, *a, **k):  # two ranks: this one and a peer whose 5th value is peer["ending"]
        sent.append(list(values))
        return [max(v, peer["ending"]) if i == 4 else v for i, v in enumerate(values)]

    monkeypatch.setattr(comm, "reduce_host", reduce_host)
    collectives = []
    for name in ("all_reduce", "broadcast", "all_gather", "barrier"):
        monkeypatch.setattr(comm.dist, name, lambda *a, _n=name, **k: collectives.append(_n))
    clock = Clock(END - 40)
    d, _ = _deadline(tmp_path, clock, save_secs=10.0, margin=5.0)
    rank0 = RunControl(None, None, None, max_nonfinite=3, saving=True, deadline=d)
    other = RunControl(None, None, None, max_nonfinite=3, saving=True)
    try:
        d.begin()
        decisions = []
        for it in range(1, 20):
            clock.t += 4.0
            flags = rank0.exchange(1.0)
            peer["ending"] = float(flags[4])
            decisions.append((it, rank0.decide(it, flags), other.decide(it, other.exchange(1.0))))
            if decisions[-1][1].exit:
                break
    finally:
        rank0.close()
        other.close()
    it, mine, theirs = decisions[-1]
    assert it == 6  # 4 s steps from END - 40: after the 6th, 16 s are left, and 4 + 10 + 5 do not fit
    assert (mine.save, mine.exit) == (theirs.save, theirs.exit) == (True, True)
    assert mine.reason.startswith("the job ends at") and theirs.reason == "the Slurm job's end is near"
    assert all(len(v) == 5 for v in sent) and len(sent) == 2 * it  # one reduce per exchange, one value more
    assert [v[4] for v in sent[::2]] == [0.0] * 5 + [1.0] and all(v[4] == 0.0 for v in sent[1::2])
    assert collectives == []


def test_run_files_roundtrip(tmp_path):
    assert run_files.read_finished(str(tmp_path)) is None
    path = run_files.write_finished(str(tmp_path), 40, 160, {"SLURM_JOB_ID": "12"})
    assert json.loads(open(path).read())["iteration"] == 40 and run_files.read_finished(str(tmp_path))["job"] == "12"
    (tmp_path / run_files.SAVE_TIME).write_text("{torn")
    assert run_files.read_save_time(str(tmp_path)) is None


def test_failure_records_and_the_hosts_to_exclude(tmp_path):
    log = fr.FailureLog(str(tmp_path / "ckpt" / fr.FILE), "100")
    log.write(3, "frontier00007", fr.LOST_RANK, "lost rank 3: no heartbeat for 61 s\nmore")
    assert fr.hosts_to_exclude(fr.read_records(log.path)) == {}  # once, not hardware: perhaps our own bug
    with open(log.path, "a") as f:
        f.write("{torn line\n")
    fr.FailureLog(log.path, "101").write(4, "frontier00007", fr.STUCK_RANK)
    fr.FailureLog(log.path, "101").write(0, "frontier00002", fr.DEVICE_ERROR, "HIP error: uncorrectable ECC")
    records = fr.read_records(log.path)
    assert [(r.job, r.rank, r.host, r.cause) for r in records] == [
        ("100", 3, "frontier00007", "lost_rank"), ("101", 4, "frontier00007", "stuck_rank"),
        ("101", 0, "frontier00002", "device_error")]
    assert records[0].detail == "lost rank 3: no heartbeat for 61 s"
    assert fr.hosts_to_exclude(records) == {
        "frontier00007": "2 failures (lost_rank, stuck_rank) in jobs 100, 101",
        "frontier00002": "device_error in job 101"}
    out = subprocess.run([sys.executable, "tools/campaign_nodes.py", log.path], capture_output=True, text=True,
                         check=True).stdout
    assert out == ("frontier00002\tdevice_error in job 101\n"
                   "frontier00007\t2 failures (lost_rank, stuck_rank) in jobs 100, 101\n")
    with pytest.raises(ValueError):
        log.write(1, "h", "bad cause")
    assert fr.device_error(RuntimeError("HIP error: hipErrorECCNotCorrectable")) and not fr.device_error(
        RuntimeError("Connection closed by peer"))
    assert this_host({"SLURMD_NODENAME": "frontier01234"}) == "frontier01234"


def test_a_save_in_flight_is_drained_before_the_stop_and_counted(monkeypatch, tmp_path):
    """--async-save: a stop first finishes the save in flight, so the deadline adds the slowest rank's remaining
    write (agreed in the previous flags all-reduce; unknown before its first file: a whole save). With 30 s of drain
    the run stops earlier than without."""
    from megatron.resilience.control import UNKNOWN_DRAIN, RunControl

    calls = []
    saver = SimpleNamespace(status=lambda: [1.0, 0.0], on_agreed=lambda values: None,
                            drain_estimate_s=lambda: None if calls.append(1) or len(calls) == 1 else 30.0)
    sent = []
    monkeypatch.setattr(comm, "reduce_host", lambda values, *a, **k: sent.append(list(values)) or list(values))

    def stop_iteration(with_saver) -> int:
        clock = Clock(END - 100)
        d, _ = _deadline(tmp_path, clock, save_secs=10.0, margin=5.0)
        control = RunControl(None, None, None, max_nonfinite=3, saving=True, deadline=d,
                             saver=saver if with_saver else None)
        try:
            d.begin()
            for it in range(1, 40):
                clock.t += 4.0
                if control.decide(it, control.exchange(1.0)).exit:
                    return it
        finally:
            control.close()
        raise AssertionError("never stopped")

    plain = stop_iteration(False)
    drained = stop_iteration(True)
    assert sent[-1][5:] == [1.0, 0.0, 30.0]  # busy, errno, this rank's drain: in the same all-reduce
    assert [v[7] for v in sent[-drained:]][0] == UNKNOWN_DRAIN  # before its first file: unknown
    # 4 s steps from END - 100: without a save in flight 4 + 10 + 5 s must fit, with one 30 s more
    assert (plain, drained) == (21, 13)


EVALS = dl.EvalPlan(interval=10, iters=5, global_batch=4, valid=True, test=True)
"""Every 10 iterations 5 batches of 4 samples (20 samples); at the end 20 of validation and 20 of test."""


def _eval_deadline(tmp_path, clock, world_size=2, train_iters=100, save_interval=None, lines=None):
    settings = dl.DeadlineSettings(job_id="77", end_time=END, margin_secs=5.0, save_dir=str(tmp_path),
                                   train_iters=train_iters, save_interval=save_interval)
    lines = [] if lines is None else lines
    return dl.Deadline(settings, _end(), dl.SavePrediction(10.0, "estimated"), clock=clock, say=lines.append,
                       evals=EVALS, world_size=world_size), lines


def _stop_iteration(d, clock, start=0, step=2.0) -> int:
    d.begin()
    for it in range(start + 1, 1000):
        clock.t += step
        if d.should_stop(0.0, it):
            return it
        if EVALS.periodic(it):  # the evaluation runs between the check and the next step
            clock.t += d.eval_secs(EVALS.periodic(it))
            d.evaluated(d.eval_secs(EVALS.periodic(it)) or 1e-9, EVALS.periodic(it))
    raise AssertionError("never stopped")


def test_evaluations_are_budgeted_once_measured_and_kept_for_the_next_job(tmp_path):
    clock = Clock(END - 100)
    d, lines = _eval_deadline(tmp_path, clock)
    assert d.eval_secs(20) == 0.0 and "not measured yet" in d.eval.source  # judged on its first batches instead
    d.evaluated(30.0, 20)  # 1.5 s a sample on 2 ranks
    assert d.eval_secs(20) == 30.0 and lines[-1] == "> evaluation took 30.0 s (predicted 0.0 s)"
    kept = run_files.read_run_times(str(tmp_path))
    assert (kept["eval_sample_secs"], kept["eval_world"], kept["eval_job"]) == (1.5, 2, "77")
    assert run_files.read_save_time(str(tmp_path)) is None  # no save measured yet: the save record is not faked
    # from END - 100, 2 s steps: after 9 the evaluation of 10 (30 s) joins the step, a save (10 s) and the margin
    # (5 s): 47 s, and 82 s are left; after 19 (10's evaluation done) 32 s are left: stop before 20's evaluation
    stop = _stop_iteration(d, clock)
    assert stop == 19 and d.reason.endswith("the next step (2.0 s), the next evaluation (30.0 s), a save (10.0 s) and "
                                            "the margin (5.0 s) would not fit in the 32 s left"), (stop, d.reason)
    # (unbudgeted, the step, a save and the margin, 17 s, fit: 20's 30 s evaluation would have run past the end)
    # the next job, at 4 ranks: the same global batches over twice the ranks, half the time
    d4, _ = _eval_deadline(tmp_path, Clock(0.0), world_size=4)
    assert d4.eval_secs(20) == 15.0 and d4.eval.source == "measured by job 77 at 2 ranks, scaled to 4"


def test_this_iterations_evaluation_and_interval_save_count_and_the_last_iteration_never_stops(tmp_path):
    clock = Clock(END - 40)
    d, _ = _eval_deadline(tmp_path, clock, save_interval=10, train_iters=20)
    d.evaluated(10.0, 20)
    d.begin()
    clock.t += 2.0
    assert not d.should_stop(0.0, 9)  # 2 + 10 (next evaluation) + 10 (a save) + 5 <= 38
    clock.t += 2.0
    assert d.should_stop(0.0, 10)  # its evaluation, its interval save, a step, a save, the margin: 37 > 36
    assert d.reason == (f"the job ends at {dl._clock(END)}: this iteration's evaluation (10.0 s), its interval save "
                        "(10.0 s), the next step (2.0 s), a save (10.0 s) and the margin (5.0 s) would not fit in the "
                        "36 s left"), d.reason
    clock.t = END - 1
    assert not d.should_stop(0.0, 20)  # no step follows the last iteration: the end saves, and judges its evaluation


def test_an_evaluation_under_way_goes_on_stops_after_or_moves(tmp_path):
    clock = Clock(END - 50)
    d, _ = _eval_deadline(tmp_path, clock)
    d.begin()
    clock.t += 2.0
    d.should_stop(0.0, 9)  # a 2 s step known
    judge = d.judge_evaluation
    # periodic, after step 10: the rest (rest) then the next step (2 s), a save (10 s) and the margin (5 s)
    assert judge("periodic", 10, "the evaluation at iteration 10", 3.0, 20.0, 0.0, True)[0] == GO  # 37 <= 48
    verdict, reason, line = judge("periodic", 10, "the evaluation at iteration 10", 3.0, 32.0, 0.0, True)
    assert verdict == STOP_AFTER and line == "" and reason.startswith(
        f"the job ends at {dl._clock(END)}: after the evaluation at iteration 10 (~35 s), the next step (2.0 s), a "
        "save (10.0 s), the margin (5.0 s) would not fit in the 16 s left"), reason
    verdict, reason, line = judge("periodic", 10, "the evaluation at iteration 10", 3.0, 34.0, 0.0, True)
    assert verdict == MOVE and line == ("> the evaluation at iteration 10 (~37 s predicted, 3 s of it done) does not "
                                        "fit before the job's end (48 s left, with a save and the margin): moved to "
                                        "the next job, which runs it first")
    assert judge("periodic", 10, "x", 3.0, 30.0, 20.0, True)[0] == MOVE  # 20 s of a save in flight first
    # the end of training needs only the margin after it
    assert judge("end", 100, "e", 3.0, 43.0, 0.0, True)[0] == GO
    verdict, _, line = judge("end", 100, "the end-of-training evaluation (valid and test)", 3.0, 44.0, 0.0, True)
    assert verdict == MOVE and line.endswith("(48 s left): moved to the next job; the run is marked finished after it")
    _, _, alone = judge("end", 100, "the end-of-training evaluation (valid and test)", 3.0, 44.0, 0.0, False)
    assert alone.endswith("although this job did nothing else: it is longer than the job's time limit allows; ask "
                          "for more time (sbatch -t) or fewer --eval-iters")
    # moved here, before the first step: the margin to run it, then a step and a save to train after it
    assert judge("moved", 10, "m", 3.0, 40.0, None, False)[0] == STOP_AFTER
    assert judge("moved", 10, "m", 3.0, 30.0, None, False)[0] == GO


def test_an_unreadable_end_time_is_named():
    run = run_config_from_args(parse_args(TINY), 1, 256)
    s = dl.DeadlineSettings.from_run(run, {"SLURM_JOB_ID": "9", "SLURM_JOB_END_TIME": "tomorrow"})
    assert (s.end_time, s.unreadable_end_time) == (None, "tomorrow")
    assert dl.DeadlineSettings.from_run(run, {"SLURM_JOB_END_TIME": " 1764150000 "}).end_time == 1764150000.0
    assert dl.DeadlineSettings.from_run(run, {"SLURM_JOB_END_TIME": ""}).unreadable_end_time is None
    end = dl.EndTime(dataclasses.replace(s, reread_secs=0), query=lambda job: 2000.0)
    assert end.value == 2000.0 and end.source == "squeue (SLURM_JOB_END_TIME='tomorrow' is not a time)"


def test_an_unreadable_end_time_without_squeue_is_said_as_such(capsys, monkeypatch):
    monkeypatch.setattr(dl, "squeue_end_time", lambda job: None)
    assert dl.start_deadline(dl.DeadlineSettings(job_id="5", unreadable_end_time="tomorrow"), None, 2, 0) is None
    assert dl.start_deadline(dl.DeadlineSettings(job_id="5"), None, 2, 0) is None
    out = capsys.readouterr().out.splitlines()
    assert out == ["> job 5: end time unknown (SLURM_JOB_END_TIME='tomorrow' is not a time in seconds since the epoch, "
                   "squeue gave none): stopping only on signals, --exit-duration-in-mins or --exit-interval",
                   "> job 5: end time unknown (no SLURM_JOB_END_TIME, squeue gave none): stopping only on signals, "
                   "--exit-duration-in-mins or --exit-interval"]


def test_run_times_merge_and_the_moved_evaluation_record(tmp_path):
    run_files.write_save_time(str(tmp_path), 8.0, "1", 40, 0.5)
    run_files.update_run_times(str(tmp_path), eval_sample_secs=0.25, eval_world=2, eval_job="2")
    kept = run_files.read_run_times(str(tmp_path))
    assert (kept["save_secs"], kept["step_secs"], kept["eval_sample_secs"], kept["eval_job"]) == (8.0, 0.5, 0.25, "2")
    run_files.write_save_time(str(tmp_path), 9.0, "3", 50, None)
    assert run_files.read_run_times(str(tmp_path))["eval_sample_secs"] == 0.25  # a save keeps the evaluation's
    assert run_files.read_moved_evaluation(str(tmp_path)) is None
    run_files.write_moved_evaluation(str(tmp_path), 500, "3")
    assert run_files.read_moved_evaluation(str(tmp_path))["iteration"] == 500
    run_files.clear_moved_evaluation(str(tmp_path))
    assert run_files.read_moved_evaluation(str(tmp_path)) is None and run_files.read_moved_evaluation(None) is None
