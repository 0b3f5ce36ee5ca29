"""A training campaign through examples/frontier/smoke_1node.sbatch on the stand-in Slurm: a tiny GPT on 2 ranks,
jobs whose end time is about a minute after their start, saves slowed to ~8 s, and upstream's default evaluation at
the end of training (--eval-iters 100 on the validation and the test split, no periodic one before --eval-interval
1000) slowed to ~20 s, more than the deadline's margin. One straight run (one job under -q debug, so no chain) and
one campaign, reused by every test here:

- job 1 gets SIGUSR1 on its batch shell only (B:), job 2 SIGUSR1 on rank 1 only, job 3 SIGTERM on rank 1 only;
  every later job runs until its deadline (or the end of training);
- the losses of every iteration equal the straight run's bit for bit; every job exits 0, before its end time,
  with a whole checkpoint; each job submits one successor and the one pending at the end is cancelled;
- from the second job on, the save time predicted at start is within 50% of the measured one;
- the end-of-training evaluation is logged by the last job alone, with the straight run's numbers bit for bit, and
  ``finished`` is written by that job (the job that reached the last iteration runs it when it fits, else moves it);
  afterwards, a job on the state a move leaves (``finished`` removed) runs only that evaluation and finishes the run.

On a loaded machine the start-up of a job (imports, process group, engine) takes longer than 45 s allows: the
job length grows with the straight run's measured start-up (room for twice it before the evaluation and the margin),
and the step is slowed (a sleep, no CPU) so that a deadline job cannot finish the run alone, whatever the length.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron.checkpointing.live import verify
from megatron.checkpointing.locate import expected_files
from tests.campaign.common import Place, iterations_logged, log_of
from tests.models import CAMPAIGN_GPT

ITERS = 32
SAVE_SLEEP = 8.0
SIGNALS = {0: ("batch", signal.SIGUSR1), 1: (1, signal.SIGUSR1), 2: (1, signal.SIGTERM)}
SIGNAL_AFTER = 3  # iterations of the job logged before its signal
EVAL = ("--eval-interval", "1000", "--eval-iters", "100")  # upstream's defaults: only the end of training evaluates
EVAL_MICRO_BATCHES = 2 * 100 * 2  # valid and test, 100 global batches of 2 micro-batches on each of the 2 ranks
_START = re.compile(r"> job (\d+) ends at .*? \(in (\d+) s, [^)]*\); predicted save ([\d.]+) s \(([^)]*)\)")
_SAVED = re.compile(r"> checkpoint save took ([\d.]+) s \(predicted ([\d.]+) s\)")


def _clock(secs: int) -> str:
    return f"{secs // 60}:{secs % 60:02d}"


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    root = tmp_path_factory.mktemp("campaign")
    straight = Place(root / "straight", ITERS, RUN_DIR=str(root / "straight" / "runs" / "straight"))
    straight_id = straight.sbatch("-q", "debug", "-t", "20:00", args=(*CAMPAIGN_GPT, *EVAL))
    straight_jobs = straight.run(max_jobs=3)
    start = _START.search(log_of(straight_jobs[0]))
    assert start, log_of(straight_jobs[0])[-3000:]
    startup = 20 * 60 - int(start.group(2))  # job start -> first iteration done
    # The job that only evaluates (the end-of-training evaluation moved to it) needs its start-up, the evaluation
    # (~20 s) and the deadline's 15 s margin: room for a start-up twice the straight run's, as the load of the tests
    # beside varies (45 s failed when start-ups went from 5 s to 10 s).
    limit = max(45 + max(0, math.ceil(1.5 * startup) - 15), math.ceil(2 * startup) + 40)
    # A deadline job trains ~(limit - start-up - save - margin) seconds; its start-up may be half the straight run's.
    # At this step it does about 12 iterations at most: the ~20 left after the signalled jobs take 2-3 jobs.
    step_sleep = max(0.3, (limit - SAVE_SLEEP - 15 - startup / 2) / 12)
    # The end-of-training evaluation: longer than the deadline's 15 s margin, well inside a job after its start-up.
    end_eval = max(20.0, 0.3 * (limit - startup))

    slow = (f"phase=step,action=sleep:{step_sleep:.2f};rank=0,phase=save,action=sleep:{SAVE_SLEEP};"  # docs/faults.md
            f"phase=eval,action=sleep:{end_eval / EVAL_MICRO_BATCHES:.4f}")
    place = Place(root / "campaign", ITERS, RUN_DIR=str(root / "campaign" / "runs" / "camp"), MEGATRON_FAULT=slow)
    first = place.sbatch("-t", _clock(limit), args=(*CAMPAIGN_GPT, *EVAL))
    order: list[str] = []

    def watch(running):
        if running.job["id"] not in order:
            order.append(running.job["id"])
        plan = SIGNALS.get(order.index(running.job["id"]))
        if plan is None or running.sent:
            return
        if len(iterations_logged(running.output())) >= SIGNAL_AFTER:
            target, sig = plan
            if target == "batch":
                running.signal_batch_shell(sig)
            elif running.ranks():
                running.signal_rank(target, sig)

    jobs = place.run(max_jobs=12, watch=watch)
    return SimpleNamespace(root=root, place=place, straight=straight, straight_id=straight_id,
                           straight_jobs=straight_jobs, first=first, jobs=jobs, limit=limit, startup=startup,
                           step_sleep=step_sleep, end_eval=end_eval,
                           ckpt=Path(root / "campaign" / "runs" / "camp" / "checkpoints"))


def _ran(c) -> list[dict]:
    """The campaign's jobs that ran (the last successor is cancelled, never run)."""
    return [j for j in c.jobs if j.get("start")]


def test_cpu_and_shape(campaign):
    jobs = _ran(campaign)
    cpu = sum(j.get("rank_cpu_s", 0) for j in jobs)
    print(f"campaign: {len(jobs)} jobs of {campaign.limit} s (start-up {campaign.startup} s, step sleep "
          f"{campaign.step_sleep:.2f} s, end-of-training evaluation ~{campaign.end_eval:.0f} s), ranks' CPU "
          f"{cpu:.0f} s; straight run {campaign.straight_jobs[0].get('rank_cpu_s', 0):.0f} s")
    assert len(jobs) >= 4, [(j["id"], j["state"]) for j in jobs]  # 3 signalled jobs, then deadline jobs


def test_losses_equal_one_straight_run_bit_for_bit(campaign):
    straight = campaign.straight.result(campaign.straight_id)["losses"]
    assert sorted(straight) == list(range(1, ITERS + 1))
    seen: dict[int, float] = {}
    for job in _ran(campaign):
        got = campaign.place.result(job["id"])
        assert got is not None, log_of(job)[-3000:]
        assert not set(got["losses"]) & set(seen), f"job {job['id']} repeated iterations"
        seen.update(got["losses"])
    assert seen == straight  # every iteration once, each loss equal to the straight run's float, bit for bit
    assert len(set(straight.values())) > ITERS // 2  # the loss moves: equality is not trivial


def test_every_job_exits_zero_before_its_end_with_a_whole_checkpoint(campaign):
    for job in _ran(campaign):
        assert job["rc"] == 0 and not job["timed_out"], (job["id"], job["rc"], log_of(job)[-3000:])
        assert job["ended"] <= job["end_time"], (job["id"], job["ended"] - job["end_time"])
        last = campaign.place.result(job["id"])["iterations"]
        tag = campaign.ckpt / f"global_step{last}"
        assert tag.is_dir(), f"job {job['id']} left no checkpoint of its last iteration {last}"
        meta = json.loads((tag / "megatron_meta.json").read_text())
        bad, has_manifest = verify.offline_problems(str(tag), expected_files(meta))
        assert has_manifest and not bad, (tag, bad)
        assert max(p.stat().st_mtime for p in tag.iterdir()) <= job["end_time"]
    assert (campaign.ckpt / "latest").read_text().strip() == f"global_step{ITERS}"
    assert json.loads((campaign.ckpt / "finished").read_text())["iteration"] == ITERS


def test_each_job_submits_one_successor_and_the_pending_one_is_cancelled(campaign):
    ran = _ran(campaign)
    submits = campaign.place.calls("sbatch")
    for job in ran:
        mine = [c for c in submits if c["from_job"] == job["id"]]
        assert len(mine) == 1, (job["id"], mine)
        assert f"--dependency=afterany:{job['id']}" in mine[0]["args"]
    successors = {j["id"]: j for j in campaign.place.jobs()}
    last = ran[-1]
    pending = [j for j in successors.values() if j.get("submitted_by") == last["id"]]
    assert len(pending) == 1 and pending[0]["state"] == "CANCELLED" and not pending[0].get("start")
    assert [c["args"] for c in campaign.place.calls("scancel") if c["from_job"] == last["id"]] == [[pending[0]["id"]]]
    assert f"cancelled the pending successor job {pending[0]['id']}" in log_of(last)
    # every job ran as the successor of the one before it, with the same arguments and time limit
    for before, after in zip(ran, ran[1:], strict=False):
        assert after["dependency"] == f"afterany:{before['id']}" and after["args"] == before["args"]
        assert after["time"] and after["env"]["CAMPAIGN_PREV"] == before["id"]


def test_signals_stop_every_rank_at_the_same_iteration_with_a_checkpoint(campaign):
    ran = _ran(campaign)
    for index, (target, sig) in SIGNALS.items():
        job = ran[index]
        assert job["sent"] and job["sent"][0][1] == sig, job["sent"]
        r0, r1 = campaign.place.result(job["id"], 0), campaign.place.result(job["id"], 1)
        assert r0["iterations"] == r1["iterations"], (r0, r1)
        assert r0["exit_reason"] == r1["exit_reason"] == "signal (SIGTERM/SIGUSR1)"
        assert f"> exiting at iteration {r0['iterations']} after a checkpoint: signal" in log_of(job)
        if target == "batch":
            assert "campaign: SIGUSR1 received by the batch shell: forwarded" in log_of(job)


def test_deadline_stops_in_time_and_predicts_the_slow_save(campaign):
    ran = _ran(campaign)
    deadline_jobs = [j for j in ran if "after a checkpoint: the job ends at" in log_of(j)]
    assert deadline_jobs, [log_of(j)[-1500:] for j in ran]
    for job in deadline_jobs:
        r0, r1 = campaign.place.result(job["id"], 0), campaign.place.result(job["id"], 1)
        assert r0["iterations"] == r1["iterations"] and r0["exit_reason"].startswith("the job ends at")
    for job in ran[1:]:
        text = log_of(job)
        if not iterations_logged(text):
            continue  # a job that only ran the end-of-training evaluation: no step, no save to predict
        start, saves = _START.search(text), _SAVED.findall(text)
        assert start and saves, text[-3000:]
        predicted, measured = float(start.group(3)), float(saves[0][0])
        assert measured >= SAVE_SLEEP
        assert abs(predicted - measured) <= 0.5 * measured, (job["id"], predicted, measured, start.group(4))
        assert start.group(4).startswith("measured by job")


def test_the_end_of_training_evaluation_is_logged_once_with_the_straight_runs_numbers(campaign):
    straight = campaign.straight.result(campaign.straight_id)["final_eval"]
    assert set(straight) == {"valid", "test"}, straight
    ran = _ran(campaign)
    evaluated = [j for j in ran if campaign.place.result(j["id"])["final_eval"]]
    assert [j["id"] for j in evaluated] == [ran[-1]["id"]], [(j["id"], log_of(j)[-2000:]) for j in ran]
    assert campaign.place.result(ran[-1]["id"])["final_eval"] == straight  # the same batches: equal bit for bit
    for split in ("validation", "test"):
        line = f"validation loss at iteration {ITERS} on 400-sample draw from {split} set"
        assert [log_of(j).count(line) for j in ran] == [0] * (len(ran) - 1) + [1], split
    finished = json.loads((campaign.ckpt / "finished").read_text())
    assert (finished["iteration"], finished["job"]) == (ITERS, ran[-1]["id"])
    moved = [j for j in ran if "does not fit before the job's end" in log_of(j)]
    print(f"the end-of-training evaluation ran in job {ran[-1]['id']}, "
          f"{'moved from job ' + moved[0]['id'] if moved else 'in the job that reached the last iteration'}")
    if moved:  # the job that reached the last iteration had too little time left: the next one ran only it
        assert [j["id"] for j in moved] == [ran[-2]["id"]] and iterations_logged(log_of(ran[-2]))[-1] == ITERS
        assert "moved to the next job; the run is marked finished after it" in log_of(ran[-2])
        assert not iterations_logged(log_of(ran[-1]))


def test_debug_qos_runs_alone(campaign):
    job = campaign.straight_jobs[0]
    assert len(campaign.straight_jobs) == 1 and job["rc"] == 0
    text = log_of(job)
    assert text.count("campaign: -q debug: OLCF prohibits job chains there") == 1
    assert campaign.straight.calls("sbatch") == [c for c in campaign.straight.calls("sbatch") if not c["from_job"]]


def test_a_job_on_a_finished_run_exits_at_once(campaign):
    place = campaign.place
    again = place.sbatch("-t", _clock(campaign.limit))
    job, = place.run(max_jobs=1)
    assert job["id"] == again and job["rc"] == 0
    assert f"campaign: run smoke_1node is finished at iteration {ITERS}" in log_of(job)
    assert not [c for c in place.calls("srun") + place.calls("sbatch") if c["from_job"] == again]
    assert os.path.exists(campaign.ckpt / "finished")


def test_a_job_that_only_evaluates_finishes_the_run(campaign):
    """The state a job that moved the end-of-training evaluation leaves (the last iteration saved, no ``finished``),
    made here whatever the campaign's timing did: its successor runs no step, evaluates with the straight run's
    numbers and writes ``finished`` (no slowed evaluation: the cheap way)."""
    place = campaign.place
    (campaign.ckpt / "finished").unlink()
    # A window that fits the evaluation the run predicts: the campaign's slowed one as measured (under load ~50 s
    # of sleeps and compute: the job's own evaluation, not slowed, is then over in about a second).
    again = place.sbatch("-t", "10:00", args=(*CAMPAIGN_GPT, *EVAL), MEGATRON_FAULT="")
    job, = place.run(max_jobs=1)
    text = log_of(job)
    assert job["id"] == again and job["rc"] == 0 and job["ended"] <= job["end_time"], text[-3000:]
    assert not iterations_logged(text) and place.result(again)["final_eval"] == \
        campaign.straight.result(campaign.straight_id)["final_eval"]
    for split in ("validation", "test"):
        assert text.count(f"validation loss at iteration {ITERS} on 400-sample draw from {split} set") == 1
    finished = json.loads((campaign.ckpt / "finished").read_text())
    assert (finished["iteration"], finished["job"]) == (ITERS, again)
