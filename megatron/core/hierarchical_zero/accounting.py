"""Bytes per tier from counted collectives: turn {(group ranks, op): payload bytes} into what one rank sends.

The counters themselves are tests/distributed/perf_probe.py's (``TorchDistCounter`` wraps torch.distributed, so it
sees DeepSpeed's collectives; ``ObserverCounter`` hooks megatron/core/comm.py, so it sees ours as logical ops).
Payload convention as megatron/perf/comm.py: the unsharded tensor (an all-gather's output, a reduce-scatter's or
all-to-all's input).

Two ways to put a rank's bytes on a tier:

* ``group``: everything the rank sends in a collective is charged to the slowest link its group crosses, the
  convention of megatron/perf/comm.py and of the ZeRO++ paper's per-GPU cross-node volume;
* ``ring``: only the sends to its successor in a ring over the group (in rank order) that cross that tier, i.e.
  what a topology-oblivious ring really puts on the wire. A flat ring over 2 nodes crosses the network on 2 of
  its hops only, so this figure is much smaller than ``group`` for flat collectives and equal for groups that hold
  one rank per node (the hierarchical network stage).
"""

from __future__ import annotations

from megatron.topology import TIERS, Placement, group_tier

WIRE_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
               "reduce": lambda n: (n - 1) / n, "broadcast": lambda n: (n - 1) / n, "send": lambda n: 1.0,
               "recv": lambda n: 0.0}
"""Share of a collective's payload one rank sends under ring algorithms."""


def _pair_tier(a: int, b: int, placements: list[Placement]) -> str:
    return group_tier([a, b], placements)


def tier_bytes(counts: dict[tuple[tuple[int, ...], str], int], placements: list[Placement], rank: int,
               steps: int = 1, mode: str = "group") -> dict[str, float]:
    """Bytes ``rank`` sends per step on each tier (``mode`` 'group' or 'ring', see the module docstring)."""
    out = dict.fromkeys(TIERS, 0.0)
    for (ranks, op), payload in counts.items():
        n = len(ranks)
        if n < 2 or op not in WIRE_FACTOR:
            continue
        sent = payload * WIRE_FACTOR[op](n) / steps
        if mode == "group":
            out[group_tier(list(ranks), placements)] += sent
        elif rank in ranks:
            ring = sorted(ranks)
            succ = ring[(ring.index(rank) + 1) % n]
            out[_pair_tier(rank, succ, placements)] += sent
    return out


def bytes_by_op(counts: dict[tuple[tuple[int, ...], str], int], placements: list[Placement],
                steps: int = 1) -> dict[tuple[str, str, int], float]:
    """Payload bytes per step by (tier, op, group size), for the bench table."""
    out: dict[tuple[str, str, int], float] = {}
    for (ranks, op), payload in counts.items():
        if len(ranks) < 2:
            continue
        key = (group_tier(list(ranks), placements), op, len(ranks))
        out[key] = out.get(key, 0.0) + payload / steps
    return out
