"""The hang verdict: from every rank's published position (megatron/progress.py), which rank(s) the others wait for.

A rank inside collective #k of a group waits for every member whose count of that group's collectives is below k:
that member has not reached it. Following these edges ends at the culprits: ranks others wait for that wait for
nobody themselves (stuck in their own code, or in a collective every member has entered). With no such edge and every
rank inside a collective, the collective itself hangs. A rank that did not publish at all is lost (dead, or a thread
of it holds Python's GIL). Pure functions: tests/unit feed them positions.

A position, as a rank publishes it (JSON): ``{"it": 12, "ph": "backward", "age": 31.2, "stalled": true, "coll":
["all_reduce", "3", 57] or null, "err": null or "first line of the collective's error", "n": {"0": 40, "3": 57},
"host": "frontier01234", "gcd": "4"}``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from megatron.progress import describe
from megatron.resilience.failure_record import COLLECTIVE_HANG, LOST_RANK, STUCK_RANK

NAMED = 4
"""Culprits named in the line (the count of the rest follows)."""


@dataclass
class Verdict:
    kind: str
    """"stuck", "collective_hang" or "lost"."""
    culprits: list[int]
    line: str
    """The one line every rank prints after ``error: ``."""
    dump: list[int]
    """Ranks that write their Python stacks (the culprits, ranks waiting on them, rank 0): never all of them."""
    records: list[tuple[int, str, str]] = field(default_factory=list)
    """(rank, host, cause) for the failure record; the detail is the line."""


def _ident(rank: int, pos: dict | None, hosts: dict) -> str:
    host, gcd = (pos["host"], pos["gcd"]) if pos else hosts.get(rank, ("?", "?"))
    return f"rank {rank} (host {host}, GCD {gcd})"


def _where(pos: dict) -> str:
    return describe(pos["ph"], tuple(pos["coll"]) if pos.get("coll") else None)


def _members(gid: str, world: int, index: dict[str, list[int]]) -> list[int]:
    if gid == "0":
        return list(range(world))
    if gid.startswith("p2p:"):
        return [int(r) for r in gid[4:].split("-") if int(r) >= 0]
    return index.get(gid, [])


def waits(positions: dict[int, dict], world: int) -> dict[tuple[str, int], tuple[list[int], list[int]]]:
    """(group, k) -> (ranks waiting inside collective #k of that group, members that have not reached it)."""
    index: dict[str, list[int]] = defaultdict(list)
    for r, pos in positions.items():
        for gid in pos["n"]:
            index[gid].append(r)
    waiting: dict[tuple[str, int], list[int]] = defaultdict(list)
    for r, pos in positions.items():
        if pos.get("coll"):
            _, gid, k = pos["coll"]
            waiting[(gid, k)].append(r)
    out = {}
    for (gid, k), ranks in waiting.items():
        behind = [m for m in _members(gid, world, index)
                  if m in positions and positions[m]["n"].get(gid, 0) < k]
        out[(gid, k)] = (ranks, behind)
    return out


def judge(positions: dict[int, dict], world: int, missing: list[int] | None = None, hosts: dict | None = None,
          census_wait: float = 0.0, stacks: str = "") -> Verdict:
    """The verdict over ``world`` ranks. ``missing``: ranks that did not publish (not finished); ``hosts``: rank ->
    (host, gcd) for those; ``stacks``: where the stack files go (named in the line)."""
    hosts = hosts or {}
    first = _first_failure(positions, hosts)
    tail = (f" ({first})" if first else "") + (f"; Python stacks in {stacks}" if stacks else "") + "; every rank exits"
    if missing:
        return _lost(sorted(missing), positions, world, hosts, census_wait, tail)
    edges = waits(positions, world)
    waiting_on: dict[int, list[tuple[int, dict]]] = defaultdict(list)  # culprit -> (a waiter, its position)
    has_out = set()
    for ranks, behind in edges.values():
        if behind:
            has_out.update(ranks)
            for m in behind:
                waiting_on[m].append((ranks[0], len(ranks)))
    sinks = [m for m in waiting_on if m not in has_out]
    if not sinks:
        outside = [r for r, p in positions.items() if not p.get("coll")]
        if waiting_on or not outside:
            return _collective_hang(positions, world, tail)
        sinks = outside  # nobody waits on anybody, yet some ranks are stuck in their own code
    sinks.sort(key=lambda r: (positions[r]["it"], r))
    return _stuck(sinks, positions, waiting_on, world, hosts, tail)


def _first_failure(positions: dict[int, dict], hosts: dict) -> str:
    failed = sorted(r for r, p in positions.items() if p.get("err"))
    if not failed:
        return ""
    r = failed[0]
    return f"rank {r}'s {positions[r]['coll'][0]} failed first: {positions[r]['err']}"


def _stuck(culprits: list[int], positions: dict[int, dict], waiting_on: dict, world: int, hosts: dict,
           tail: str) -> Verdict:
    c, pos = culprits[0], positions[culprits[0]]
    line = (f"{_ident(c, pos, hosts)} is stuck in {_where(pos)} for {pos['age']:.0f} s at iteration {pos['it']}"
            + ("" if pos.get("coll") else ", not in a collective"))
    waiters = waiting_on.get(c, [])
    if waiters:
        w, _ = waiters[0]
        count = sum(n for _, n in waiters)
        line += (f"; {count} rank{'s' if count > 1 else ''} wait{'' if count > 1 else 's'} for it"
                 f"{', e.g.' if count > 1 else ':'} rank {w} in {_where(positions[w])}")
    others = culprits[1:]
    if others:
        named = ", ".join(f"{_ident(r, positions[r], hosts)} in {_where(positions[r])} for "
                          f"{positions[r]['age']:.0f} s" for r in others[:NAMED - 1])
        more = f" and {len(others) - NAMED + 1} more" if len(others) > NAMED - 1 else ""
        line += f"; also stuck: {named}{more}"
    dump = []
    for r in culprits[:NAMED]:
        dump.append(r)
        dump.extend(w for w, _ in waiting_on.get(r, [])[:2])
    dump.append(0)
    records = [(r, positions[r]["host"], STUCK_RANK) for r in culprits]
    return Verdict("stuck", culprits, line + tail, _unique(dump, world), records)


def _collective_hang(positions: dict[int, dict], world: int, tail: str) -> Verdict:
    inside = {r: tuple(p["coll"]) for r, p in positions.items() if p.get("coll")}
    age = min(p["age"] for p in positions.values())
    it = min(p["it"] for p in positions.values())
    if len(set(inside.values())) == 1 and len(inside) == len(positions):
        what = _where(positions[min(inside)])
        line = f"collective hang: every rank in {what} for {age:.0f} s at iteration {it}"
    else:
        r = min(inside) if inside else min(positions)
        line = (f"collective hang: every rank waits in a collective, in {len(set(inside.values()))} different ones "
                f"(e.g. rank {r} in {_where(positions[r])}), for {age:.0f} s at iteration {it}: mismatched "
                "collectives, or a collective that does not complete")
    return Verdict("collective_hang", [], line + tail, _unique([0, 1, world - 1], world),
                   [(-1, "?", COLLECTIVE_HANG)])


def _lost(missing: list[int], positions: dict[int, dict], world: int, hosts: dict, census_wait: float,
          tail: str) -> Verdict:
    named = ", ".join(_ident(r, None, hosts) for r in missing[:NAMED])
    more = f" and {len(missing) - NAMED} more" if len(missing) > NAMED else ""
    who = "it" if len(missing) == 1 else "they"
    line = (f"lost {named}{more}: {who} did not answer the hang census within {census_wait:.0f} s (dead, or a thread "
            "holds Python's GIL)")
    dump = [0] + [n for r in missing[:NAMED] for n in ((r - 1) % world, (r + 1) % world)]
    records = [(r, hosts.get(r, ("?", "?"))[0], LOST_RANK) for r in missing]
    return Verdict("lost", missing, line + tail, [r for r in _unique(dump, world) if r in positions], records)


def _unique(ranks: list[int], world: int) -> list[int]:
    return list(dict.fromkeys(r for r in ranks if 0 <= r < world))
