"""megatron/topology.py against FRONTIER.md's tables: rank discovery, rank -> GCD / cores, group tiers."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from megatron.errors import ConfigError, DistributedError
from megatron.topology import (
    check_cpu_binding,
    check_tp_within_node,
    coordinates,
    discover_ranks,
    frontier_placement,
    group_reports,
    parallel_groups,
    parse_nodelist,
    parse_tasks_per_node,
)
from tests.launch import MPI_AND_SLURM, clean_env, run_command

# FRONTIER.md, typed in by hand (not derived from the module): local rank -> (GCD, NUMA, first core of its L3).
# "srun ... --gpu-bind=closest places local ranks 0..7 on GCDs 4,5,2,3,6,7,0,1" + the NUMA/cores table.
FRONTIER_TABLE = {
    0: (4, 0, 0), 1: (5, 0, 8), 2: (2, 1, 16), 3: (3, 1, 24),
    4: (6, 2, 32), 5: (7, 2, 40), 6: (0, 3, 48), 7: (1, 3, 56),
}


def slurm_env(rank: int, nodes: int, with_ids: bool = True) -> dict[str, str]:
    """What srun -N nodes -n nodes*8 sets for one task (block distribution)."""
    env = {
        "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(nodes * 8), "SLURM_TASKS_PER_NODE": f"8(x{nodes})",
        "SLURM_NODELIST": f"frontier[{1:05d}-{nodes:05d}]" if nodes > 1 else "frontier00001",
        "SLURM_JOB_ID": "123",
    }
    if with_ids:
        env.update(SLURM_LOCALID=str(rank % 8), SLURM_NODEID=str(rank // 8))
    return env


@pytest.mark.parametrize("nodes", [1, 2, 128])
@pytest.mark.parametrize("with_ids", [True, False])
def test_simulated_slurm_matches_frontier_tables(nodes, with_ids):
    world = nodes * 8
    placements = frontier_placement(world)
    for rank in range(world):
        info = discover_ranks(slurm_env(rank, nodes, with_ids), use_mpi4py=False)
        assert (info.source, info.rank, info.world_size) == ("slurm", rank, world)
        assert (info.node_index, info.local_rank, info.local_world_size) == (rank // 8, rank % 8, 8)
        assert (info.master_addr, info.master_port) == ("frontier00001", 29500)
        p = placements[rank]
        gcd, numa, first = FRONTIER_TABLE[rank % 8]
        assert (p.node_index, p.local_rank, p.gcd, p.numa, p.package) == (rank // 8, rank % 8, gcd, numa, gcd // 2)
        # -S 8 reserves the first core of each L3 region: 7 cores left, exactly srun -c7.
        assert p.cores == tuple(range(first + 1, first + 8))
        assert p.smt_siblings == tuple(range(first + 65, first + 72))


def test_placement_without_low_noise_uses_all_8_cores():
    p = frontier_placement(8, low_noise=False)[6]
    assert (p.gcd, p.cores, p.smt_siblings[0]) == (0, tuple(range(48, 56)), 112)


def test_core_sets_partition_the_56_usable_cores():
    cores = [c for p in frontier_placement(8) for c in p.cores]
    assert sorted(cores) == [c for c in range(64) if c % 8]


def test_fewer_ranks_per_node_follow_closest_order():
    ps = frontier_placement(8, ranks_per_node=4)
    assert [(p.node_index, p.gcd) for p in ps] == [(0, 4), (0, 5), (0, 2), (0, 3), (1, 4), (1, 5), (1, 2), (1, 3)]
    with pytest.raises(ConfigError):
        frontier_placement(16, ranks_per_node=16)


@pytest.mark.parametrize("nodelist,hosts", [
    ("frontier[00001-00004,00010]",
     ["frontier00001", "frontier00002", "frontier00003", "frontier00004", "frontier00010"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("frontier00042", ["frontier00042"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("r[1-2]n[1-2],x[7]", ["r1n1", "r1n2", "r2n1", "r2n2", "x7"]),
])
def test_parse_nodelist(nodelist, hosts):
    assert parse_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["a[1-2", "a]1[", "a[x-2]"])
def test_parse_nodelist_rejects_malformed(bad):
    with pytest.raises(DistributedError):
        parse_nodelist(bad)


@pytest.mark.parametrize("nodelist,master", [
    ("frontier[00001-00004,00010]", "frontier00001"), ("frontier[00007,00003]", "frontier00007"), ("a[1-2],b3", "a1"),
])
def test_master_addr_from_compressed_nodelist(nodelist, master):
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "40", "SLURM_LOCALID": "3", "SLURM_JOB_NODELIST": nodelist,
           "SLURM_TASKS_PER_NODE": "8(x5)", "MASTER_PORT": "3442"}
    info = discover_ranks(env, use_mpi4py=False)
    assert (info.master_addr, info.master_port) == (master, 3442)


def test_uneven_tasks_per_node():
    assert parse_tasks_per_node("8(x3),7") == [8, 8, 8, 7]
    env = {"SLURM_PROCID": "25", "SLURM_NTASKS": "31", "SLURM_TASKS_PER_NODE": "8(x3),7", "SLURM_NODELIST": "f[1-4]"}
    info = discover_ranks(env, use_mpi4py=False)
    assert (info.node_index, info.local_rank, info.local_world_size) == (3, 1, 7)


def test_explicit_master_addr_wins_and_bad_ints_are_named():
    env = slurm_env(0, 2) | {"MASTER_ADDR": "10.0.0.1"}
    assert discover_ranks(env, use_mpi4py=False).master_addr == "10.0.0.1"
    with pytest.raises(DistributedError, match="SLURM_NTASKS"):
        discover_ranks(slurm_env(0, 2) | {"SLURM_NTASKS": "eight"}, use_mpi4py=False)


def test_torchrun_env_takes_precedence():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "MASTER_ADDR": "h0", "MASTER_PORT": "1234", **slurm_env(0, 1)}
    info = discover_ranks(env, use_mpi4py=False)
    assert info == info.__class__(5, 8, 1, 4, 1, "h0", 1234, "torchrun")
    assert info.torch_env()["WORLD_SIZE"] == "8"


def test_mpi_env_without_mpi4py():
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4"}
    assert discover_ranks(env, use_mpi4py=False) == discover_ranks(env, use_mpi4py=False).__class__(
        3, 4, 3, 4, 0, "127.0.0.1", 29500, "mpi")
    ompi = {"OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "8", "MASTER_ADDR": "n0"}
    info = discover_ranks(ompi, use_mpi4py=False)
    assert (info.rank, info.node_index, info.local_rank, info.master_addr) == (9, 1, 1, "n0")
    with pytest.raises(DistributedError, match="MASTER_ADDR"):
        discover_ranks({k: v for k, v in ompi.items() if k != "MASTER_ADDR"}, use_mpi4py=False)


def test_mpirun_inside_allocation_prefers_mpi():
    # Every task inherits the batch step's SLURM_PROCID=0; the MPI rank is the real one.
    env = slurm_env(0, 1) | {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"}
    assert discover_ranks(env, use_mpi4py=False).source == "mpi"
    # srun with Cray PMI sets both, agreeing: Slurm wins because it knows the nodelist.
    env = slurm_env(2, 1) | {"PMI_RANK": "2", "PMI_SIZE": "8"}
    assert discover_ranks(env, use_mpi4py=False).source == "slurm"


def test_single_process_default():
    info = discover_ranks({})
    assert (info.rank, info.world_size, info.source, info.master_addr) == (0, 1, "single", "127.0.0.1")


def test_real_mpirun_discovery_via_mpi4py(tmp_path):
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    if mpirun is None:
        pytest.skip("mpirun not installed (pip install mpich mpi4py)")
    pytest.importorskip("mpi4py")
    # Each rank writes its own file: two ranks printing to one pipe interleave their lines.
    code = ("from megatron.topology import discover_ranks; i = discover_ranks(); assert discover_ranks() == i; "
            "open(f'rank{i.rank}.txt', 'w').write(' '.join(map(str, (i.rank, i.world_size, i.local_rank, "
            "i.local_world_size, i.node_index, i.master_addr, i.source))))")
    out = run_command([mpirun, "-n", "2", sys.executable, "-c", code], 120, env=clean_env(drop=MPI_AND_SLURM),
                      cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == [
        "0 2 0 2 0 127.0.0.1 mpi", "1 2 1 2 0 127.0.0.1 mpi"]


def test_megatron_rank_order():
    groups = parallel_groups(16, tp=2, pp=2)  # dp = 4
    assert groups["tp"][:3] == [[0, 1], [2, 3], [4, 5]]
    assert groups["dp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["pp"][:2] == [[0, 8], [1, 9]]
    assert coordinates(11, 16, tp=2, pp=2) == (1, 1, 1)  # tp, pp, dp
    for kind in ("tp", "dp", "pp"):
        assert sorted(r for g in groups[kind] for r in g) == list(range(16))


@pytest.mark.parametrize("nodes", [1, 2, 128])
def test_tp8_stays_in_node_and_tp2_on_one_package(nodes):
    placements = frontier_placement(nodes * 8)
    tp8 = group_reports(placements, tp=8, pp=1)["tp"]
    assert set(tp8.tiers) == {"node"}
    for g in tp8.groups:
        assert len({placements[r].node_index for r in g}) == 1
    tp2 = group_reports(placements, tp=2, pp=1)["tp"]
    assert set(tp2.tiers) == {"package"}
    for g in tp2.groups:
        assert len({placements[r].package for r in g}) == 1


def test_1t_layout_tiers():
    reports = group_reports(frontier_placement(1024), tp=8, pp=64)
    assert (reports["tp"].worst_tier, reports["dp"].worst_tier, reports["pp"].worst_tier) == (
        "node", "network", "network")
    assert (len(reports["tp"].groups), len(reports["dp"].groups), len(reports["pp"].groups)) == (128, 512, 16)
    assert reports["tp"].summary() == "TP: 128 groups of 8; tiers: 128 node"


def test_tp_across_nodes_refused_or_warned(caplog):
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size 16.*--allow-tp-across-nodes") as e:
        check_tp_within_node(32, tp=16)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError):
        check_tp_within_node(24, tp=3)  # 3 does not divide 8: some groups straddle two nodes
    report = check_tp_within_node(32, tp=16, allow_tp_across_nodes=True)
    assert report.tiers == ["network", "network"]
    assert "span nodes" in caplog.text
    assert check_tp_within_node(64, tp=8, pp=2).worst_tier == "node"


def test_check_cpu_binding():
    p = frontier_placement(8)[0]
    assert check_cpu_binding(p, actual={1, 2, 3, 4, 5, 6, 7, 65}) is None
    msg = check_cpu_binding(p, actual={0, 1, 2})
    assert msg is not None and "GCD 4" in msg and "-c7" in msg
