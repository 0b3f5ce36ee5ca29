"""pretrain_gpt.py with --ds-sequence-parallel-size: SP=1 (1 process) and SP=2 log the same lm loss at iteration 10
(SP=4 and TP x SP are checked against one process in tests/distributed/test_ulysses.py); a head count SP cannot split
is refused in one line before any process group."""

from tests.launch import free_port, losses, run_pretrain
from tests.models import TINY_GPT


def test_sp2_cli_matches_sp1():
    # A free port for the one-process run too: the default 29500 may be held by another job on a shared machine.
    ref = losses(run_pretrain(1, TINY_GPT, env={"MASTER_PORT": str(free_port())}).stdout)
    sp2 = run_pretrain(2, TINY_GPT + ["--ds-sequence-parallel-size", "2"]).stdout
    got = losses(sp2)
    assert 10 in ref and 10 in got, (ref, got)
    assert abs(got[10] - ref[10]) <= 1e-4 * abs(ref[10]), (got[10], ref[10])
    assert len({round(v, 4) for v in ref.values()}) > 5  # the run trains, so agreement is not trivial
    assert "ULYSSES groups (1 of size 2): [0, 1]" in sp2, sp2[:3000]  # rank 0's layout report names them


def test_sp_that_cannot_split_the_kv_heads_is_refused_before_the_process_group():
    # Rank 0 of a 2-rank launch (torchrun's variables, no peer): the refusal must come before the process group
    # would wait for rank 1.
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}
    proc = run_pretrain(1, TINY_GPT + ["--ds-sequence-parallel-size", "2", "--num-key-value-heads", "1"], check=False,
                        env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--num-key-value-heads 1" in lines[0], proc.stderr[-2000:]
