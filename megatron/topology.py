"""Where every rank runs on Frontier: rank discovery (torchrun / Slurm / MPI), rank -> node / MI250X package /
GCD / NUMA / CPU cores, and a tier report (package, node, network) for the TP / DP / PP groups.

Pure Python: nothing here imports torch or needs a process group, so the dry run and the tests work anywhere.
Call :func:`discover_ranks` before ``import torch`` when launched by mpirun, because mpi4py must initialise MPI
before torch loads RCCL / libfabric.

CPU cores. FRONTIER.md's NUMA table gives each GCD one L3 region of 8 cores (GCD 4 -> 0-7, GCD 5 -> 8-15,
GCD 2 -> 16-23, GCD 3 -> 24-31, GCD 6 -> 32-39, GCD 7 -> 40-47, GCD 0 -> 48-55, GCD 1 -> 56-63), with SMT
siblings at core + 64. Low-noise mode (``-S 8``, Frontier's default) reserves the *first* core of every L3
region for the system (cores 0, 8, ..., 56; OLCF Frontier User Guide, "Node Types"), which leaves exactly the
7 cores ``-c7`` asks for: GCD g owns cores first(g)+1 .. first(g)+7 and their siblings first(g)+65 .. +71.
``srun -c7 --gpu-bind=closest`` hands out those regions in core order, so local rank i gets L3 region i and
therefore GCD ``CLOSEST_GCD_ORDER[i]``.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from megatron.errors import ConfigError, DistributedError

logger = logging.getLogger(__name__)

GCDS_PER_NODE = 8
CORES_PER_L3 = 8
SMT_OFFSET = 64
DEFAULT_MASTER_PORT = 29500
CLOSEST_GCD_ORDER = (4, 5, 2, 3, 6, 7, 0, 1)
"""GCD of local rank 0..7 under ``srun -n8 -c7 --gpus-per-task=1 --gpu-bind=closest`` (FRONTIER.md)."""
TIERS = ("package", "node", "network")
"""Link tiers from fastest (200 GB/s inside one MI250X) to slowest (100 GB/s per node over Slingshot)."""


# ---------------------------------------------------------------------------------------------------------------
# Rank discovery
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankInfo:
    """Who this process is in the job, and where rank 0 listens."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    """Ranks on this node, from the launcher; never from ``torch.cuda.device_count()`` (1 under --gpus-per-task=1)."""
    node_index: int
    master_addr: str
    master_port: int
    source: str
    """'torchrun', 'slurm', 'mpi' or 'single'."""

    def torch_env(self) -> dict[str, str]:
        """The variables ``torch.distributed.init_process_group(init_method='env://')`` reads."""
        return {
            "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` that is set, as an int; a non-integer value is a launcher error worth naming."""
    for name in names:
        value = environ.get(name)
        if value is not None and value.strip() != "":
            try:
                return int(value)
            except ValueError:
                raise DistributedError(f"environment variable {name}={value!r} is not an integer: "
                                       "fix the launcher environment") from None
    return None


def _port(environ: Mapping[str, str]) -> int:
    return _int(environ, "MASTER_PORT") or DEFAULT_MASTER_PORT


def _check(info: RankInfo) -> RankInfo:
    if not (0 <= info.rank < info.world_size and 0 <= info.local_rank < info.local_world_size):
        raise DistributedError(
            f"inconsistent {info.source} environment: rank {info.rank} of {info.world_size}, local rank "
            f"{info.local_rank} of {info.local_world_size}: check the launcher's task counts")
    return info


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist: ``frontier[00001-00002,00010]`` -> frontier00001, frontier00002, frontier00010.

    Handles several comma-separated entries (``a[1-2],b3``), zero padding, and more than one bracket in a name
    (``r[1-2]n[1-2]``, a cartesian product, as Slurm does).
    """
    entries, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            break
        if ch == "," and depth == 0:
            entries.append(nodelist[start:i])
            start = i + 1
    if depth:  # a bracket closed before it opened, nested, or left open
        raise DistributedError(f"malformed Slurm nodelist {nodelist!r}: unbalanced brackets")
    entries.append(nodelist[start:])
    hosts: list[str] = []
    for entry in (e.strip() for e in entries):
        if entry:
            hosts.extend(_expand_entry(entry, nodelist))
    return hosts


def _expand_entry(entry: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", entry)
    if m is None:
        return [entry]
    prefix, suffix = entry[:m.start()], entry[m.end():]
    names = []
    for part in m.group(1).split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise DistributedError(f"malformed Slurm nodelist {whole!r}: bad range {part!r}")
        width = len(lo)  # Slurm keeps the zero padding of the lower bound
        for n in range(int(lo), int(hi or lo) + 1):
            names.append(f"{prefix}{n:0{width}d}")
    # The suffix may hold further brackets: expand them for every name built so far.
    return [name + rest for name in names for rest in _expand_entry(suffix, whole)] if suffix else names


def parse_tasks_per_node(value: str) -> list[int]:
    """Expand ``SLURM_TASKS_PER_NODE``: ``8(x3),7`` -> [8, 8, 8, 7]."""
    counts: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise DistributedError(f"cannot parse SLURM_TASKS_PER_NODE={value!r}: expected a form like '8(x4)'")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _from_torchrun(env: Mapping[str, str]) -> RankInfo:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_rank = _int(env, "LOCAL_RANK") or 0
    local_world = _int(env, "LOCAL_WORLD_SIZE") or world
    node = _int(env, "GROUP_RANK")  # torchrun's node rank
    return RankInfo(rank, world, local_rank, local_world, rank // local_world if node is None else node,
                    env.get("MASTER_ADDR") or "127.0.0.1", _port(env), "torchrun")


def _from_slurm(env: Mapping[str, str]) -> RankInfo:
    rank = _int(env, "SLURM_PROCID")
    world = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if world is None:
        raise DistributedError("SLURM_PROCID is set but SLURM_NTASKS is not: launch with srun -n <ranks>")
    # The step's own counts first: the allocation's SLURM_TASKS_PER_NODE may describe a different step.
    uniform = _int(env, "SLURM_NTASKS_PER_NODE")
    per_node_env = env.get("SLURM_STEP_TASKS_PER_NODE") or (None if uniform else env.get("SLURM_TASKS_PER_NODE"))
    per_node = parse_tasks_per_node(per_node_env) if per_node_env else [uniform or world]
    node = _int(env, "SLURM_NODEID")
    if node is None:  # srun's default block distribution: fill one node, then the next
        node = _node_of_rank(rank, per_node)
    local_world = per_node[min(node, len(per_node) - 1)]
    local_rank = _int(env, "SLURM_LOCALID")
    if local_rank is None:
        local_rank = rank - sum(per_node[:node]) if len(per_node) > 1 else rank % local_world
    master = env.get("MASTER_ADDR")
    if not master:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise DistributedError("cannot find rank 0's host: neither MASTER_ADDR nor SLURM_NODELIST is set")
        master = parse_nodelist(nodelist)[0]  # block distribution puts rank 0 on the first host
    return RankInfo(rank, world, local_rank, local_world, node, master, _port(env), "slurm")


def _node_of_rank(rank: int, counts: list[int]) -> int:
    if len(counts) == 1:
        return rank // counts[0]
    first = 0
    for node, count in enumerate(counts):
        if rank < first + count:
            return node
        first += count
    return len(counts) - 1


_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


_MPI4PY_CACHE: dict = {}


def _mpi4py_hosts() -> list[str] | None:
    """Every rank's hostname via mpi4py (None if it is not installed), gathered once per process.

    Cached because the allgather is a collective: a second discover_ranks() call from one rank only would hang.
    """
    if "hosts" not in _MPI4PY_CACHE:
        torch = sys.modules.get("torch")
        if torch is not None and getattr(getattr(torch, "version", None), "hip", None):
            logger.warning("mpi4py initialised after torch: on Frontier call discover_ranks() before importing "
                           "torch, or MPI_Init may clash with RCCL/libfabric")
        try:
            from mpi4py import MPI
        except ImportError:
            return None
        comm = MPI.COMM_WORLD
        _MPI4PY_CACHE["rank"] = comm.Get_rank()
        # Every rank learns every hostname: exact node index and local rank for any placement of ranks.
        _MPI4PY_CACHE["hosts"] = comm.allgather(socket.gethostname())
    return _MPI4PY_CACHE["hosts"]


def _from_mpi(env: Mapping[str, str], use_mpi4py: bool) -> RankInfo:
    hosts = _mpi4py_hosts() if use_mpi4py else None
    if hosts is not None:
        rank, world = _MPI4PY_CACHE["rank"], len(hosts)
        order = list(dict.fromkeys(hosts))
        node = order.index(hosts[rank])
        local_rank = hosts[:rank].count(hosts[rank])
        local_world = hosts.count(hosts[rank])
        # One host: loopback avoids depending on the container's hostname resolving.
        master = env.get("MASTER_ADDR") or ("127.0.0.1" if len(order) == 1 else hosts[0])
        return RankInfo(rank, world, local_rank, local_world, node, master, _port(env), "mpi")
    rank = _int(env, *_MPI_RANK_VARS)
    world = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")
    if world is None:
        raise DistributedError("an MPI rank variable is set but no size (OMPI_COMM_WORLD_SIZE / PMI_SIZE): "
                               "launch with mpirun -n <ranks>")
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")
    if local_world is None:
        local_world, local_rank = world, rank
    master = env.get("MASTER_ADDR")
    if not master:
        if local_world != world:
            raise DistributedError("mpirun across nodes needs rank 0's host: install mpi4py or export MASTER_ADDR")
        master = "127.0.0.1"
    # Without mpi4py we assume mpirun's default block placement (fill one node, then the next).
    return RankInfo(rank, world, local_rank if local_rank is not None else rank % local_world, local_world,
                    rank // local_world, master, _port(env), "mpi")


def discover_ranks(environ: Mapping[str, str] = os.environ, use_mpi4py: bool = True) -> RankInfo:
    """Find rank, world size and rank 0's address from whichever launcher started this process.

    Precedence: torchrun variables (RANK + WORLD_SIZE), then Slurm (SLURM_PROCID), then MPI. When Slurm and MPI
    variables are both present and disagree on the rank, mpirun was used inside an allocation (every task then
    inherits the batch step's SLURM_PROCID=0), so MPI wins. No launcher variables: a single process.
    """
    env = environ
    if env.get("RANK") is not None and env.get("WORLD_SIZE") is not None:
        return _check(_from_torchrun(env))
    mpi_rank = _int(env, *_MPI_RANK_VARS)
    slurm_rank = _int(env, "SLURM_PROCID")
    if slurm_rank is not None and (mpi_rank is None or mpi_rank == slurm_rank):
        return _check(_from_slurm(env))
    if mpi_rank is not None:
        return _check(_from_mpi(env, use_mpi4py))
    return RankInfo(0, 1, 0, 1, 0, env.get("MASTER_ADDR") or "127.0.0.1", _port(env), "single")


# ---------------------------------------------------------------------------------------------------------------
# Placement: rank -> node / package / GCD / NUMA / cores
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where one rank runs on a Frontier node."""

    rank: int
    node_index: int
    local_rank: int
    gcd: int
    package: int
    """MI250X package (0-3): the two GCDs of one package share the 200 GB/s link."""
    numa: int
    cores: tuple[int, ...]
    """Physical cores bound by ``srun -c7`` (7 with -S 8, 8 with -S 0)."""
    smt_siblings: tuple[int, ...]
    """The second hardware thread of each core (core + 64)."""


def gcd_first_core(gcd: int) -> int:
    """First core of the L3 region wired to ``gcd`` (FRONTIER.md's NUMA table)."""
    return CLOSEST_GCD_ORDER.index(gcd) * CORES_PER_L3


def place_local_rank(local_rank: int, low_noise: bool = True) -> tuple[int, int, int, tuple[int, ...]]:
    """(gcd, package, numa, cores) of one local rank under closest binding."""
    if not 0 <= local_rank < GCDS_PER_NODE:
        raise ConfigError(f"local rank {local_rank}: a Frontier node has {GCDS_PER_NODE} GCDs, launch at most "
                          f"{GCDS_PER_NODE} ranks per node (srun -n $((N*8)))")
    gcd = CLOSEST_GCD_ORDER[local_rank]
    first = gcd_first_core(gcd)
    cores = tuple(range(first + (1 if low_noise else 0), first + CORES_PER_L3))
    return gcd, gcd // 2, first // (2 * CORES_PER_L3), cores


def frontier_placement(world_size: int, ranks_per_node: int = GCDS_PER_NODE, low_noise: bool = True) -> list[Placement]:
    """Placement of every global rank, for a block layout of ``ranks_per_node`` ranks per node."""
    if world_size < 1:
        raise ConfigError(f"--world-size {world_size}: need at least one rank")
    if not 1 <= ranks_per_node <= GCDS_PER_NODE:
        raise ConfigError(f"{ranks_per_node} ranks per node: Frontier runs one rank per GCD, 1 to 8 per node")
    out = []
    for rank in range(world_size):
        node, local = divmod(rank, ranks_per_node)
        gcd, package, numa, cores = place_local_rank(local, low_noise)
        out.append(Placement(rank, node, local, gcd, package, numa, cores, tuple(c + SMT_OFFSET for c in cores)))
    return out


def check_cpu_binding(placement: Placement, actual: set[int] | None = None) -> str | None:
    """A message if this process's CPU affinity is not the expected core set (None when it matches).

    Siblings are accepted as part of the expected set; ``actual`` defaults to ``os.sched_getaffinity(0)``.
    """
    if actual is None:
        actual = set(os.sched_getaffinity(0))
    expected = set(placement.cores) | set(placement.smt_siblings)
    if actual and actual <= expected and set(placement.cores) & actual:
        return None
    return (f"rank {placement.rank} (GCD {placement.gcd}) is bound to cores {sorted(actual)} but its L3 region is "
            f"{list(placement.cores)}: launch with srun -c7 --gpu-bind=closest (and #SBATCH -S 8)")


# ---------------------------------------------------------------------------------------------------------------
# Parallel groups and the tiers they span
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupReport:
    """All groups of one kind ('tp', 'dp', 'pp', or with Ulysses 'ulysses' / 'ulysses_dp') and the slowest link each
    crosses."""

    kind: str
    groups: list[list[int]]
    tiers: list[str]

    @property
    def size(self) -> int:
        return len(self.groups[0])

    @property
    def worst_tier(self) -> str:
        return max(self.tiers, key=TIERS.index)

    def summary(self) -> str:
        counts = ", ".join(f"{self.tiers.count(t)} {t}" for t in TIERS if t in self.tiers)
        note = " (size 1: no communication)" if self.size == 1 else ""
        return f"{self.kind.upper()}: {len(self.groups)} groups of {self.size}; tiers: {counts}{note}"


def check_world_divides(world_size: int, tp: int, pp: int, ulysses: int = 1) -> None:
    """The ranks split into TP x PP (x Ulysses SP) x DP: the config's check (megatron/config/parallel.py), the dry
    run's and the planner's, and the groups'."""
    if ulysses > 1 and world_size % (tp * pp * ulysses):
        raise ConfigError(f"world size {world_size} is not divisible by TP {tp} x PP {pp} x "
                          f"--ds-sequence-parallel-size {ulysses} = {tp * pp * ulysses}: launch a multiple of "
                          f"{tp * pp * ulysses} ranks or shrink the sizes")
    if world_size % (tp * pp):
        raise ConfigError(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                          f"--pipeline-model-parallel-size {pp} = {tp * pp}: launch a multiple of {tp * pp} ranks or "
                          "shrink TP/PP")


def check_expert_parallel(world_size: int, tp: int, pp: int, ulysses: int, ep: int) -> None:
    """The experts' EP ranks are consecutive data-parallel ranks: EP divides the data-parallel size."""
    dp = world_size // (tp * pp * ulysses)
    if dp % ep:
        raise ConfigError(f"--moe-expert-parallel-size {ep} does not divide the data-parallel size {dp} (world "
                          f"{world_size} / TP {tp} / PP {pp}): the expert-parallel ranks are data-parallel ranks; use "
                          f"a divisor of {dp}")


def parallel_groups(world_size: int, tp: int, pp: int, ulysses: int = 1,
                    ep: int | None = None) -> dict[str, list[list[int]]]:
    """Megatron's rank order (TP innermost, then DP, then PP): rank = (pp_i * dp + dp_i) * tp + tp_i.

    With DeepSpeed-Ulysses (``ulysses`` > 1) that data-parallel dimension splits into SP (inner) x DP (outer):
    "ulysses_dp" holds the former DP groups (gradients and ZeRO shards span them), "ulysses" their consecutive runs of
    ``ulysses`` ranks (one sequence's shards: the all-to-alls), "dp" their strided members (different samples).

    A model with experts (``ep`` not None, 1 included) splits each DP group into EP (inner) x replicas: "ep" holds
    its consecutive runs of ``ep`` ranks (one copy of all experts: the token all-to-alls, inside a node where they
    fit), "edp" its strided members (the replicas of the same experts: their gradients), as DeepSpeed's expert
    groups. 16 ranks, TP=2, EP=2: EP [0,2] [4,6] ... [1,3] ..., EDP [0,4,8,12] [2,6,10,14] [1,5,9,13] ..."""
    check_world_divides(world_size, tp, pp, ulysses)
    dp = world_size // (tp * pp)
    groups = {
        "tp": [[(p * dp + d) * tp + t for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[(p * dp + d) * tp + t for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[(p * dp + d) * tp + t for p in range(pp)] for d in range(dp) for t in range(tp)],
    }
    if ulysses > 1:
        ulysses_dp = groups["dp"]
        groups["ulysses"] = [g[i:i + ulysses] for g in ulysses_dp for i in range(0, dp, ulysses)]
        groups["dp"] = [g[j::ulysses] for g in ulysses_dp for j in range(ulysses)]
        groups["ulysses_dp"] = ulysses_dp
    if ep is not None:
        check_expert_parallel(world_size, tp, pp, ulysses, ep)
        groups["ep"] = [g[i:i + ep] for g in groups["dp"] for i in range(0, dp, ep)]
        groups["edp"] = [g[j::ep] for g in groups["dp"] for j in range(ep)]
    return groups


def coordinates(rank: int, world_size: int, tp: int, pp: int) -> tuple[int, int, int]:
    """(tp_rank, pp_rank, dp_rank) of a global rank in Megatron's order."""
    dp = world_size // (tp * pp)
    return rank % tp, rank // (tp * dp), (rank // tp) % dp


def group_tier(ranks: list[int], placements: list[Placement]) -> str:
    """The slowest tier a group crosses: 'package', 'node' or 'network'."""
    nodes = {placements[r].node_index for r in ranks}
    if len(nodes) > 1:
        return "network"
    return "package" if len({placements[r].package for r in ranks}) == 1 else "node"


def group_reports(placements: list[Placement], tp: int, pp: int, ulysses: int = 1,
                  ep: int | None = None) -> dict[str, GroupReport]:
    """Every group kind of ``parallel_groups`` (with experts, ``ep`` given: "ep" and "edp" too) and its tiers."""
    groups = parallel_groups(len(placements), tp, pp, ulysses, ep)
    return {kind: GroupReport(kind, gs, [group_tier(g, placements) for g in gs]) for kind, gs in groups.items()}


def check_tp_within_node(world_size: int, tp: int, pp: int = 1, ranks_per_node: int = GCDS_PER_NODE,
                         allow_tp_across_nodes: bool = False) -> GroupReport:
    """Refuse (ConfigError) a layout whose TP groups cross nodes; with the override, warn loudly instead.

    TP all-reduces run twice per layer in forward and backward: over Slingshot they are latency-bound
    (FRONTIER.md), so a TP group that leaves the node slows every layer.
    """
    report = group_reports(frontier_placement(world_size, ranks_per_node), tp, pp)["tp"]
    crossing = report.tiers.count("network")
    if crossing:
        msg = (f"--tensor-model-parallel-size {tp} puts {crossing} of {len(report.groups)} TP groups across nodes "
               f"({ranks_per_node} ranks per node): use a TP size that divides {ranks_per_node} (<= 8), "
               f"or pass --allow-tp-across-nodes")
        if not allow_tp_across_nodes:
            raise ConfigError(msg)
        logger.warning("!" * 100)
        logger.warning("WARNING: --allow-tp-across-nodes: %d TP groups of %d span nodes; every layer's TP "
                       "all-reduce will cross Slingshot and the run will be slow", crossing, tp)
        logger.warning("!" * 100)
    return report
