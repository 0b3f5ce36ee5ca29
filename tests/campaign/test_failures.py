"""Failed jobs in a campaign, on the stand-in Slurm: a run that fails at start twice in a row stops its chain with
one line; a rank lost twice on one host makes the successor exclude that host (failure records written by the
watchdog that names the lost rank, examples/frontier/campaign.sh's ExcNodeList update)."""

from __future__ import annotations

import json
import signal

import pytest

from megatron.resilience.failure_record import read_records
from tests.campaign.common import (NODE_CHANGE_ARGS, NODE_CHANGE_ENV, NODE_CHANGE_ITERS, Place, iterations_logged,
                                   log_of, non_loopback_ip)


def test_two_failures_at_start_stop_the_chain_with_one_line(tmp_path):
    place = Place(tmp_path, 10, RUN_DIR=str(tmp_path / "runs" / "crash"), TEST_FAIL_AT_START="1")
    first = place.sbatch("-t", "5:00")
    ran = place.run(max_jobs=5)
    assert [j["rc"] for j in ran] == [1, 1], [(j["id"], j["rc"], log_of(j)[-2000:]) for j in ran]
    jobs = {j["id"]: j for j in place.jobs()}
    second = ran[1]["id"]
    third, = [j for j in jobs.values() if j.get("submitted_by") == second]
    assert third["state"] == "CANCELLED" and not third.get("start")  # the chain ends before a third try
    assert ran[0]["id"] == first and ran[1]["dependency"] == f"afterany:{first}"
    lines = [line for j in ran for line in log_of(j).splitlines() if "campaign: stopping" in line]
    assert len(lines) == 1, lines
    assert ("campaign: stopping run smoke_1node: 2 jobs in a row ended without a new checkpoint" in lines[0]
            and f"cancelled the successor job {third['id']}" in lines[0])
    assert "stopping" not in log_of(ran[0])  # one failure alone does not stop the chain


def test_a_rank_lost_twice_on_a_host_excludes_it_from_the_successor(tmp_path, straight_two_nodes):
    """Two jobs on a machine of two nodes; each saves at iteration 2 / 4, then loses rank 1 (SIGKILL) on
    frontier00002. The first record alone changes nothing (it may be our bug); after the second, the pending successor
    excludes the host, and the log names it. With CAMPAIGN_MIN_NODES=1 that successor asks for 1-2 nodes, so it
    starts on the one left, resumes the last checkpoint at DP 1 in place and trains to the end on the losses of a
    straight 2-node run within 1e-5 relative (tests/campaign/conftest.py)."""
    master = non_loopback_ip()
    if master is None:
        pytest.skip("no non-loopback IPv4 address here: a job of two fake nodes cannot rendezvous")
    # 20 s, not less: with the campaigns beside the xdist workers a loaded machine can keep rank 0's store from
    # answering for several seconds (seen at 5 s, and at 10 s under load 20), and rank 1 then rightly names rank 0
    # lost too (a record this test does not expect). The timeout costs this test only the detection of each kill.
    args = (*NODE_CHANGE_ARGS, "--save-interval", "2", "--watchdog-timeout-secs", "20")
    place = Place(tmp_path, NODE_CHANGE_ITERS, RUN_DIR=str(tmp_path / "runs" / "lost"),
                  MEGATRON_FAULT="phase=step,action=sleep:0.3", MASTER_ADDR=master, FAKE_SLURM_NODES="2",
                  CAMPAIGN_MIN_NODES="1", **NODE_CHANGE_ENV)
    place.sbatch("-N", "2", "-t", "20:00", args=args)
    killed: list[str] = []

    def watch(running):
        if len(killed) < 2 and not running.sent and len(iterations_logged(running.output())) >= 3 and running.ranks():
            running.signal_rank(1, signal.SIGKILL)
            killed.append(running.job["id"])

    ran = place.run(max_jobs=3, watch=watch)
    assert len(ran) == 3 and all(j["rc"] != 0 for j in ran[:2]), [(j["rc"], log_of(j)[-2000:]) for j in ran]
    ckpt = tmp_path / "runs" / "lost" / "checkpoints"
    records = read_records(str(ckpt / "failures.jsonl"))
    assert [(r.job, r.rank, r.host, r.cause) for r in records] == [
        (ran[0]["id"], 1, "frontier00002", "lost_rank"), (ran[1]["id"], 1, "frontier00002", "lost_rank")]
    assert all("lost rank 1" in r.detail for r in records)
    first_successor, second_successor = ran[1], ran[2]
    assert second_successor["submitted_by"] == first_successor["id"]
    assert first_successor["exclude"] == "" and ran[0]["hosts"] == ran[1]["hosts"] == ["frontier00001",
                                                                                      "frontier00002"]
    assert second_successor["exclude"] == "frontier00002"
    assert [j["options"]["nodes"] for j in ran[1:]] == ["1-2", "1-2"]  # CAMPAIGN_MIN_NODES-this job's nodes
    updates = [c["args"] for c in place.calls("scontrol") if c["args"][:1] == ["update"]]
    assert updates == [["update", f"JobId={second_successor['id']}", "ExcNodeList=frontier00002"]]
    assert (f"campaign: successor job {second_successor['id']} excludes frontier00002 (2 failures (lost_rank) in "
            f"jobs {ran[0]['id']}, {ran[1]['id']})") in log_of(ran[1])
    assert "excludes" not in log_of(ran[0])
    # each job saved before it lost the rank: no crash loop, the chain goes on
    assert "stopping" not in log_of(ran[1]) and json.loads((ckpt / "save_time.json").read_text())["save_secs"] >= 0

    # The third job: on the node left, from the last checkpoint, at DP 1, to the end.
    third = log_of(second_successor)
    assert second_successor["hosts"] == ["frontier00001"] and second_successor["rc"] == 0, third[-3000:]
    ledger = [line.split("\t") for line in (tmp_path / "runs" / "lost" / "campaign.tsv").read_text().splitlines()]
    tag = ledger[2][2]  # the checkpoint the third job started on: job 2's last
    assert ledger[2][0] == second_successor["id"] and tag.startswith("global_step"), ledger
    start = int(tag.removeprefix("global_step"))
    assert ("> layout changed from TP 1 x PP 1 x DP 2 x EP 1, ZeRO-1 (2 ranks) to TP 1 x PP 1 x DP 1 x EP 1, ZeRO-1 "
            f"(1 rank): resumed {tag} in place") in third, third[-3000:]
    assert "global batch 4 stays, gradient accumulation 2 -> 4" in third
    assert json.loads((ckpt / "finished").read_text())["iteration"] == NODE_CHANGE_ITERS
    losses, straight = place.result(second_successor["id"])["losses"], straight_two_nodes["losses"]
    assert sorted(losses) == list(range(start + 1, NODE_CHANGE_ITERS + 1))
    for i in losses:
        assert abs(losses[i] / straight[i] - 1) < 1e-5, (i, losses, straight)
