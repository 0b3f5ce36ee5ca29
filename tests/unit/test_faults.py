"""MEGATRON_FAULT (megatron/faults.py): its grammar and one-line refusals, where a fault matches (rank, phase,
iteration, file), each action, and the points that fire it: the progress record's moves and a checkpoint write."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time

import pytest

from megatron import faults
from megatron.checkpointing.live import integrity
from megatron.errors import ConfigError
from megatron.progress import PROGRESS, Identity, Progress


def _armed(text: str, rank: int = 0) -> Progress:
    p = Progress()
    p.identity = Identity(rank, "node0", "-")
    p.restart(faults.Faults(faults.parse(text)))
    return p


def test_grammar():
    one, two = faults.parse("rank=1,phase=send activation,iteration=3,action=block; phase=step,action=sleep:0.3")
    assert one == faults.Fault("send activation", "block", None, 1, 3)
    assert two == faults.Fault("step", "sleep", 0.3)
    assert faults.parse("rank=*,phase=forward,iteration=201+,action=spin:0.2") == (
        faults.Fault("forward", "spin", 0.2, None, 201, True),)
    assert faults.parse("phase=write,file=global_step4.tmp-,action=raise:ENOSPC")[0].file == "global_step4.tmp-"
    assert faults.parse("phase=save,action=exit:7")[0].arg == 7
    assert faults.parse("phase=log,action=signal:TERM")[0].arg == "TERM"
    assert faults.from_environ({}) is None and faults.from_environ({"MEGATRON_FAULT": " "}) is None
    assert faults.from_environ({"MEGATRON_FAULT": "phase=data,action=oom"}).faults[0].action == "oom"


@pytest.mark.parametrize("text,needle", [
    ("rank=1,action=block", "needs phase= and action="),
    ("phase=data,action=explode", "unknown action 'explode'"),
    ("phase=data,action=block:3", "action block takes no argument"),
    ("phase=data,action=sleep", "action sleep takes an argument"),
    ("phase=data,action=sleep:soon", "could not convert"),
    ("phase=data,rank=one,action=block", "invalid literal"),
    ("phase=data,when=3,action=block", "'when=3' is not one of"),
    ("phase=data,action=signal:NOPE", "no signal SIGNOPE"),
    ("phase=write,action=raise:EWHAT", "no errno EWHAT"),
    ("phase=data,file=x,action=block", "file= goes with phase=write"),
])
def test_a_malformed_value_is_one_line_naming_the_variable(text, needle):
    with pytest.raises(ConfigError) as e:
        faults.parse(text)
    msg = str(e.value)
    assert msg.startswith(f"MEGATRON_FAULT={text!r}: ") and needle in msg and "\n" not in msg, msg
    assert "rank=R,phase=P,iteration=N[+],action=A[:ARG]" in msg


def test_where_a_fault_matches():
    f = faults.parse("rank=1,phase=backward,iteration=3,action=block")[0]
    assert f.matches("backward", 1, 3, None)
    assert not f.matches("backward", 0, 3, None) and not f.matches("backward", 1, 4, None)
    assert not f.matches("forward", 1, 3, None)
    later = faults.parse("phase=forward,iteration=5+,action=spin:1")[0]
    assert [later.matches("forward", r, it, None) for r, it in ((0, 4), (3, 5), (2, 9))] == [False, True, True]
    write = faults.parse("phase=write,file=global_step4.tmp-,action=sleep:1")[0]
    assert write.matches("write", 0, 7, "/s/global_step4.tmp-ab/mp_rank_00_model_states.pt")
    assert not write.matches("write", 0, 7, "/s/global_step2.tmp-ab/mp_rank_00_model_states.pt")


def test_the_progress_record_fires_faults_at_its_moves(capsys):
    assert Progress().faults is None  # unset: one attribute test per move
    p = _armed("rank=1,phase=backward,iteration=3,action=oom;phase=all_reduce,iteration=2,action=raise:EIO;"
               "phase=step,iteration=4,action=raise:EBUSY", rank=1)
    p.start_iteration(2)
    p.enter("backward")  # iteration 2: nothing
    for n in (1, 2):  # every time it matches
        with pytest.raises(OSError) as e:
            p.enter_collective("all_reduce", "0")
        assert e.value.errno == errno.EIO and p.position.collective == ("all_reduce", "0", n)  # inside it
    p.start_iteration(3)
    p.enter("forward")
    with pytest.raises(MemoryError, match="injected by MEGATRON_FAULT"):
        p.enter("backward")
    assert p.position.phase == "backward"  # the position moved first: a verdict names where the fault hit
    with pytest.raises(OSError):
        p.start_iteration(4)
    assert p.position[:2] == (4, "step") and p.faults.fired_at is not None
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("> fault injected (MEGATRON_FAULT): rank 1 (host node0, GCD -) raises OSError EIO in "
                      "all_reduce at iteration 2"), err
    assert len(err) == 3, err  # one line per fault, the first time it fires
    _armed("rank=1,phase=backward,action=oom", rank=0).enter("backward")  # another rank's fault: nothing


def test_actions():
    began = time.perf_counter()
    faults.run(faults.Fault("x", "sleep", 0.2))
    faults.run(faults.Fault("x", "spin", 0.2))
    assert 0.4 <= time.perf_counter() - began < 5
    got = []
    old = signal.signal(signal.SIGUSR2, lambda *a: got.append(a[0]))
    try:
        faults.run(faults.Fault("x", "signal", "USR2"))
    finally:
        signal.signal(signal.SIGUSR2, old)
    assert got == [signal.SIGUSR2]
    with pytest.raises(OSError) as e:
        faults.run(faults.Fault("write", "raise", "ENOSPC"), "/a/b.pt")
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, "/a/b.pt")
    blocked = threading.Thread(target=faults.run, args=(faults.Fault("x", "block"),), daemon=True)
    blocked.start()
    blocked.join(1.5)
    assert blocked.is_alive()  # forever (a daemon thread: it ends with the test process)
    pid = os.fork()
    if pid == 0:
        faults.run(faults.Fault("x", "exit", 7))
    assert os.waitpid(pid, 0)[1] >> 8 == 7


def test_a_checkpoint_write_is_a_fault_point(tmp_path):
    saved = PROGRESS.faults
    PROGRESS.restart(faults.Faults(faults.parse("phase=write,file=step4,action=raise:ENOSPC")))
    try:
        integrity.write_torch({"x": 1}, str(tmp_path / "step2.pt"))  # another file: written
        with pytest.raises(OSError) as e:
            integrity.write_torch({"x": 1}, str(tmp_path / "step4.pt"))
    finally:
        PROGRESS.restart(saved)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "step4.pt")
    assert os.path.getsize(tmp_path / "step2.pt") > 0 and os.path.getsize(tmp_path / "step4.pt") == 0
