"""A campaign that changes its node count between jobs, on the stand-in Slurm (issue 43): examples/frontier/
smoke_1node.sbatch's tiny GPT with one rank per node, the first job on 2 nodes; while it runs the user shrinks the
pending successor to 1 node (``scontrol update JobId=... NumNodes=1``), and while that one runs grows the next to 2.
Jobs 1 and 2 end on SIGUSR1 to the batch shell (a checkpoint, exit 0); job 3 trains to the end. Each successor
resumes the last checkpoint at its own data-parallel size in place (megatron/checkpointing/relayout/): the global
batch stays, the accumulation follows DP, the log says from what layout to what, and the last loss is the straight
run's within 1e-5 relative (only the order of float sums differs; the straight run is tests/campaign/conftest.py's)."""

from __future__ import annotations

import signal
import subprocess

import pytest

from tests.campaign.common import (NODE_CHANGE_ARGS, NODE_CHANGE_ENV, NODE_CHANGE_ITERS, Place, iterations_logged,
                                   log_of, non_loopback_ip)

ITERS = NODE_CHANGE_ITERS
SIGNAL_AFTER = 2  # iterations a job logs before its SIGUSR1
NODES = [1, 2]  # the node count each successor is changed to, while the job before it runs
DP = {1: "TP 1 x PP 1 x DP 1 x EP 1, ZeRO-1 (1 rank)", 2: "TP 1 x PP 1 x DP 2 x EP 1, ZeRO-1 (2 ranks)"}


@pytest.fixture(scope="module")
def grown(tmp_path_factory, straight_two_nodes):
    master = non_loopback_ip()
    if master is None:
        pytest.skip("no non-loopback IPv4 address here: a job of two fake nodes cannot rendezvous")
    root = tmp_path_factory.mktemp("layout")
    env = {**NODE_CHANGE_ENV, "MASTER_ADDR": master}
    slow = "phase=step,action=sleep:0.5"  # docs/faults.md: a job is still training when its signal comes
    place = Place(root / "campaign", ITERS, RUN_DIR=str(root / "campaign" / "run"), MEGATRON_FAULT=slow, **env)
    place.sbatch("-N", "2", "-t", "20:00", args=NODE_CHANGE_ARGS)
    order: list[str] = []

    def watch(running):
        job_id = running.job["id"]
        if job_id not in order:
            order.append(job_id)
        index = order.index(job_id)
        if index >= len(NODES) or running.sent or len(iterations_logged(running.output())) < SIGNAL_AFTER:
            return
        successor = next(j for j in place.jobs() if j.get("submitted_by") == job_id)
        subprocess.run([str(place.root / "bin" / "scontrol"), "update", f"JobId={successor['id']}",
                        f"NumNodes={NODES[index]}"], env=place.env, check=True)
        running.signal_batch_shell(signal.SIGUSR1)

    jobs = [j for j in place.run(max_jobs=len(NODES) + 2, watch=watch) if j.get("start")]
    return straight_two_nodes, place, jobs


def test_jobs_of_half_then_twice_the_nodes_end_on_the_straight_runs_loss(grown):
    straight, place, jobs = grown
    assert [len(j["hosts"]) for j in jobs] == [2, 1, 2], [(j["id"], j["hosts"], log_of(j)[-2000:]) for j in jobs]
    for job in jobs:
        assert job["rc"] == 0 and not job["timed_out"] and job["ended"] <= job["end_time"], log_of(job)[-3000:]
    losses = {}
    for job in jobs:
        losses.update(place.result(job["id"])["losses"])
    assert sorted(losses) == sorted(straight["losses"]) == list(range(1, ITERS + 1))
    assert abs(losses[ITERS] / straight["losses"][ITERS] - 1) < 1e-5, (losses, straight["losses"])


def test_the_job_log_says_the_layout_changed_from_what_to_what(grown):
    _, _, jobs = grown
    for job, (was, now) in zip(jobs[1:], [(2, 1), (1, 2)], strict=True):
        text = log_of(job)
        assert f"> layout changed from {DP[was]} to {DP[now]}: resumed global_step" in text, text[-3000:]
        assert f"global batch 4 stays, gradient accumulation {4 // was} -> {4 // now}" in text
    assert "layout changed" not in log_of(jobs[0])
