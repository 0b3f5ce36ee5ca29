"""Launch: --master-addr / --master-port, MASTER_ADDR outside the Slurm job, and a rendezvous that ends in one
line within --rendezvous-timeout-secs. Loopback only: no test contacts any other address."""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import pytest

from megatron import rendezvous
from megatron.errors import ConfigError, DistributedError
from megatron.config import RuntimeConfig
from megatron.rendezvous import rendezvous_store, resolve_master
from megatron.topology import RankInfo, discover_ranks, parse_nodelist
from tests.launch import free_port, run_pretrain, start_ranks
from tests.models import TINY_GPT

# What the ORNL/OLCF launchers leave in every task: MASTER_ADDR=$SLURM_SUBMIT_HOST (a login node). The name
# is in the reserved .invalid domain, so nothing can ever resolve or reach it.
SUBMIT = "login08.invalid"


def slurm(rank: int, **extra) -> dict[str, str]:
    """srun -N4 -n32 on frontier[00012-00015] (8 tasks a node), as one task sees it."""
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "32", "SLURM_TASKS_PER_NODE": "8(x4)",
            "SLURM_LOCALID": str(rank % 8), "SLURM_NODEID": str(rank // 8), "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "frontier[00012-00015]", "SLURM_SUBMIT_HOST": SUBMIT, "MASTER_PORT": "3442",
            **extra}


@pytest.mark.parametrize("nodelist,hosts", [
    ("frontier[00012-00015,00020]",
     ["frontier00012", "frontier00013", "frontier00014", "frontier00015", "frontier00020"]),
    ("frontier00007", ["frontier00007"]),
    ("login[1-2],frontier[09998-10001]", ["login1", "login2", "frontier09998", "frontier09999", "frontier10000",
                                          "frontier10001"]),
])
def test_hostlist_expansion(nodelist, hosts):
    assert parse_nodelist(nodelist) == hosts


def test_submit_host_is_replaced_by_the_first_node_with_one_line():
    env = slurm(9, MASTER_ADDR=SUBMIT)
    info, note = resolve_master(discover_ranks(env, use_mpi4py=False), env)
    assert (info.master_addr, info.master_port) == ("frontier00012", 3442)
    assert SUBMIT in note and "frontier00012" in note and "4242" in note and "\n" not in note
    # The flag is checked the same way (the ORNL launchers pass --master-addr too).
    info, note = resolve_master(discover_ranks(slurm(9), use_mpi4py=False), slurm(9), master_addr="login3")
    assert info.master_addr == "frontier00012" and note.startswith("--master-addr=login3")
    # The step's first node is where srun puts rank 0 when the step uses part of the allocation.
    env = slurm(3, MASTER_ADDR=SUBMIT, SLURM_STEP_NODELIST="frontier[00014-00015]")
    assert resolve_master(discover_ranks(env, use_mpi4py=False), env)[0].master_addr == "frontier00014"


@pytest.mark.parametrize("addr", ["frontier00012", "frontier00013.frontier.olcf.ornl.gov", "frontier00012-hsn0",
                                  "10.128.0.7"])
def test_a_job_node_or_an_unknown_ip_is_kept(addr, monkeypatch):
    monkeypatch.setattr(rendezvous, "_same_host", lambda ip, host: False)  # no DNS in a unit test
    env = slurm(5, MASTER_ADDR=addr)
    info, note = resolve_master(discover_ranks(env, use_mpi4py=False), env)
    assert (info.master_addr, note) == (addr, None)


def test_submit_hosts_ip_and_loopback_across_nodes_are_replaced(monkeypatch):
    monkeypatch.setattr(rendezvous, "_same_host", lambda ip, host: (ip, host) == ("10.1.2.3", SUBMIT))
    for addr in ("10.1.2.3", "127.0.0.1", "localhost"):
        env = slurm(5, MASTER_ADDR=addr)
        assert resolve_master(discover_ranks(env, use_mpi4py=False), env)[0].master_addr == "frontier00012", addr


def test_unchanged_outside_slurm_on_one_node_and_under_torchrun():
    one_node = {**slurm(1, MASTER_ADDR="127.0.0.1"), "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "8",
                "SLURM_JOB_NODELIST": "frontier00012"}
    assert resolve_master(discover_ranks(one_node, use_mpi4py=False), one_node) == (
        discover_ranks(one_node, use_mpi4py=False), None)
    plain = {"MASTER_ADDR": "somehost", "MASTER_PORT": "1234"}
    info, note = resolve_master(discover_ranks(plain), plain, master_port=4321)
    assert (info.master_addr, info.master_port, note) == ("somehost", 4321, None)
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                "TORCHELASTIC_USE_AGENT_STORE": "True"}
    info, note = resolve_master(discover_ranks(torchrun), torchrun, master_addr="elsewhere")
    assert info.master_addr == "127.0.0.1" and "--master-addr elsewhere not used" in note


def test_bad_flags_refused_in_one_line():
    with pytest.raises(ConfigError, match="--master-port 70000"):
        RuntimeConfig(master_port=70000, rendezvous_timeout_secs=60).validate()
    with pytest.raises(ConfigError, match="--rendezvous-timeout-secs"):
        RuntimeConfig(master_port=None, rendezvous_timeout_secs=0).validate()


def _info(rank: int, port: int, world: int = 2) -> RankInfo:
    return RankInfo(rank, world, rank, world, 0, "127.0.0.1", port, "torchrun")


def test_client_gives_up_within_the_bound_naming_address_and_port():
    port = free_port()  # closed: nothing listens there
    start = time.monotonic()
    with pytest.raises(DistributedError, match=rf"127\.0\.0\.1:{port} within 1\.5 s") as e:
        rendezvous_store(_info(1, port), 1.5, timedelta(minutes=10))
    assert time.monotonic() - start < 10 and e.value.every_rank and "\n" not in str(e.value)


@pytest.mark.parametrize("addr", ["127.0.0.1", SUBMIT])
def test_rank0_gives_up_within_the_bound_when_no_one_joins(addr):
    """Rank 0 reaches its own store over loopback: even an address it cannot resolve costs it only the bound."""
    port = free_port()
    start = time.monotonic()
    with pytest.raises(DistributedError, match=rf"did not all reach the rendezvous at {addr}:{port} within 1\.5 s"):
        rendezvous_store(RankInfo(0, 2, 0, 2, 0, addr, port, "slurm"), 1.5, timedelta(minutes=10))
    assert time.monotonic() - start < 10


def test_single_process_needs_no_port():
    """World size 1 meets on an in-memory store: a port another job holds does not matter."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        store = rendezvous_store(RankInfo(0, 1, 0, 1, 0, "127.0.0.1", busy.getsockname()[1], "single"), 1.0,
                                 timedelta(minutes=10))
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_pretrain_with_unreachable_master_ends_in_one_line():
    """A non-zero rank whose MASTER_ADDR:MASTER_PORT has no listener: torch alone retries for 10 minutes."""
    port = free_port()
    env = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    start = time.monotonic()
    proc = run_pretrain(1, TINY_GPT + ["--master-port", str(port), "--rendezvous-timeout-secs", "2"], timeout=120,
                        env=env, check=False)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "--rendezvous-timeout-secs" in errors[0]
    assert "Traceback" not in proc.stderr and "retrying" not in proc.stderr
    assert elapsed < 60, elapsed  # imports included; the rendezvous itself gave up after 2 s


_JOIN = """
import sys
from megatron.errors import run_cli
from megatron.initialize import initialize_distributed, shutdown
import deepspeed.comm as dist, torch

def main(argv):
    rank, world = initialize_distributed(rendezvous_timeout_secs=30)
    x = torch.ones(1) * (rank + 1)
    dist.all_reduce(x)
    print(f"sum {x.item():g}", flush=True)
    shutdown()

sys.exit(run_cli(main))
"""


def test_two_slurm_tasks_with_the_submit_host_as_master_meet_on_the_first_node(tmp_path):
    """The ORNL launcher's environment, with a one-node job on 'localhost': both tasks must meet there."""

    def slurm_task(rank: int, world: int, port: int) -> dict[str, str]:
        return dict(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="2", SLURM_LOCALID=str(rank),
                    SLURM_NODEID="0", SLURM_JOB_ID="77", SLURM_JOB_NODELIST="localhost", SLURM_SUBMIT_HOST=SUBMIT,
                    MASTER_ADDR=SUBMIT, MASTER_PORT=str(port))

    with start_ranks(2, [sys.executable, "-c", _JOIN], str(tmp_path), rank_vars=slurm_task) as ranks:
        codes = ranks.wait(120)
    outs = [(ranks.output(r), ranks.output(r, "err")) for r in range(2)]
    for code, (out, err) in zip(codes, outs, strict=True):
        assert code == 0 and "sum 3" in out, err[-2000:]
    rank0_out = outs[0][0]
    notes = [line for line in rank0_out.splitlines() if SUBMIT in line]
    assert len(notes) == 1 and "localhost" in notes[0], rank0_out
    assert SUBMIT not in outs[1][0]  # the note is printed once, by rank 0


def test_nccl_requested_without_nccl_uses_the_accelerators_backend(monkeypatch, capsys):
    """Upstream scripts pass --distributed-backend nccl (its default); a CPU torch has no NCCL."""
    import torch

    from megatron.initialize import usable_backend

    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    assert usable_backend("nccl", "gloo", rank=0) == "gloo"
    assert capsys.readouterr().out.count("--distributed-backend nccl") == 1
    assert usable_backend("nccl", "gloo", rank=3) == "gloo" and capsys.readouterr().out == ""
    assert (usable_backend(None, "gloo"), usable_backend("gloo", "nccl")) == ("gloo", "gloo")
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert usable_backend("nccl", "gloo") == "nccl"  # a torch with NCCL gets what was asked
