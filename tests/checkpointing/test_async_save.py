"""--async-save on 2 gloo ranks (issue 33): training goes on while a background writer writes the host copy, and
resuming from it is bit-exact (fp32 ZeRO-1, PP=2, hierarchical ZeRO) with a checkpoint tools/verify_checkpoint.py
passes; nothing is lost: kill -9 of a rank during the write leaves the previous checkpoint ``latest`` and loadable,
SIGTERM during the write commits it and the exit save (the second waits for the first, logged), and a full disk
in the writer is the synchronous save's one line with ``latest`` on the previous checkpoint."""

import os
import re
import signal

import pytest

from tests.checkpointing.common import exact_losses, pretrain_on, slow_async_pretrain, start_exact
from tests.models import CKPT_GPT

ASYNC = ["--async-save", "--save-interval", "2"]
PP2 = ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"]
HZERO = ["--zero-stage", "3", "--zero-hierarchy", "node,network"]


def _latest(save: str) -> str:
    return open(os.path.join(save, "latest")).read()


def _verify(save: str, tag: str | None = None) -> int:
    from tools.verify_checkpoint import main as verify_tool

    return verify_tool([save] + (["--tag", tag] if tag else []))


@pytest.mark.timeout(600)
def test_zero1_sigterm_during_a_background_write_commits_both_and_resumes_exact(tmp_path):
    save = str(tmp_path / "ckpt")
    args = CKPT_GPT + ["--zero-stage", "1", "--train-iters", "6"]
    # The writer sleeps 2 s before each file of the step-2 save: iterations 3 and 4 train while it writes, and the
    # SIGTERM sent at iteration 3 asks for an exit save at 4 while the step-2 save is still in flight.
    got = slow_async_pretrain(2, args + ASYNC + ["--save", save], slow_tag="global_step2.tmp-", slow_s=2.0,
                              sigterm_at=3)
    assert got["exit_reason"] == "signal (SIGTERM/SIGUSR1)" and got["iterations"] == 4, got["exit_reason"]
    events = got["events"]
    assert events.index(("iteration", 4)) < events.index(("commit", "global_step2")) < events.index(
        ("commit", "global_step4")), events
    said = [msg for kind, msg in events if kind == "say"]
    waited = [float(m.group(1)) for msg in said if (m := re.fullmatch(
        r"> waited (\d+\.\d+) s for the background save of global_step2 before the save of iteration 4 \(one save "
        r"in flight at most\)", msg))]
    assert len(waited) == 1 and waited[0] > 0.5, said
    assert any(msg.startswith("> waited ") and "global_step4 before exiting" in msg for msg in said), said
    assert _latest(save) == "global_step4"
    assert _verify(save) == 0 and _verify(save, "global_step2") == 0  # both checkpoints whole
    with open(os.path.join(save, "latest"), "w") as f:
        f.write("global_step2")
    # 2N straight (the run above: a background save changes no bit of training) = N + async save + resume + N
    resumed = pretrain_on(2, args + ["--load", save, "--exit-interval", "4"])["losses"]
    assert resumed == {3: got["losses"][3], 4: got["losses"][4]}, (resumed, got["losses"])
    assert len(set(got["losses"].values())) == 4


@pytest.mark.timeout(600)
def test_pp2_full_disk_in_the_writer_is_one_line_and_latest_stays(tmp_path):
    save, out = str(tmp_path / "ckpt"), str(tmp_path)
    args = CKPT_GPT + PP2 + ["--train-iters", "6"]
    # Rank 1's disk fills up as it opens its first file of the step-4 save.
    with start_exact(2, args + ASYNC + ["--save", save], out,
                     fault="rank=1,phase=write,file=global_step4.tmp-,action=raise:ENOSPC") as ranks:
        assert ranks.wait(timeout=300) == [2, 2], ranks.output(1, "err")[-3000:]
    for r in range(2):
        assert "Traceback" not in ranks.output(r, "err"), ranks.output(r, "err")[-3000:]
    last = ranks.output(0, "err").strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint save to {save} failed: out of space (ENOSPC"), last
    assert "on rank 1)" in last and "'latest' still names global_step2" in last, last
    assert _latest(save) == "global_step2" and not [n for n in os.listdir(save) if ".tmp-" in n]
    exact = exact_losses(ranks.output(0))
    assert sorted(exact)[:4] == [1, 2, 3, 4], exact
    assert _verify(save) == 0
    resumed = pretrain_on(2, args + ["--load", save, "--exit-interval", "4"])["losses"]
    assert resumed == {3: exact[3], 4: exact[4]}, (resumed, exact)


@pytest.mark.timeout(600)
def test_hierarchical_zero_kill9_during_the_write_keeps_latest_loadable(tmp_path):
    save, out, again = str(tmp_path / "ckpt"), str(tmp_path), str(tmp_path / "resume")
    args = CKPT_GPT + HZERO + ["--train-iters", "100000", "--watchdog-timeout-secs", "5"]
    # Rank 1's writer sleeps 120 s on each file of the step-4 save while training goes on.
    with start_exact(2, args + ASYNC + ["--save", save], out,
                     fault="rank=1,phase=write,file=global_step4.tmp-,action=sleep:120") as ranks:
        ranks.wait_for_line(1, r"fault injected .* in write of .*global_step4\.tmp-.*hzero_rank_00001\.pt", "err")
        ranks.wait_for_line(1, r"^EXACT 6 ")  # training went on meanwhile
        ranks[1].send_signal(signal.SIGKILL)
        codes = ranks.wait(timeout=120)
    assert codes[0] not in (0, None), ranks.output(0, "err")[-3000:]
    assert _latest(save) == "global_step2"
    tmp = [n for n in os.listdir(save) if n.startswith("global_step4.tmp-")]
    assert len(tmp) == 1 and _verify(save) == 0
    exact = exact_losses(ranks.output(0))
    os.makedirs(again)
    with start_exact(2, args + ["--load", save, "--exit-interval", "4"], again) as resumed:
        assert resumed.wait(timeout=300) == [0, 0], resumed.output(0, "err")[-3000:]
    assert exact_losses(resumed.output(0)) == {3: exact[3], 4: exact[4]}
    named = [line for line in resumed.output(0).splitlines() if "unfinished save" in line]
    assert named == [f"> {save}: 1 unfinished save(s) of an interrupted run: {tmp[0]}; not loaded, latest still "
                     "names global_step2; the next save removes them"], named
    assert _latest(save) == "global_step2" and tmp[0] in os.listdir(save)  # a resume without --save moves nothing
