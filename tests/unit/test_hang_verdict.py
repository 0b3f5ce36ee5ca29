"""The hang verdict from published positions (megatron/resilience/hang_verdict.py), and the progress record it reads."""

import re

from megatron.progress import COMM, Progress, describe_out_of_memory, is_out_of_memory
from megatron.resilience.hang_verdict import judge


def pos(it, phase, coll=None, counts=None, age=40.0, host="h", gcd="-", err=None):
    return {"it": it, "ph": phase, "age": age, "stalled": True, "coll": list(coll) if coll else None, "err": err,
            "n": counts or {"0": 0}, "host": host, "gcd": gcd}


def test_rank_that_never_reached_the_collective_is_named():
    # 2 ranks, DP group "2": rank 0 entered its 7th all-reduce there, rank 1 (still in data) has done 6.
    v = judge({0: pos(4, "backward", ("all_reduce", "2", 7), {"0": 5, "2": 7}),
               1: pos(4, "data", None, {"0": 5, "2": 6}, age=33.4, host="nid7", gcd="5")}, 2, stacks="/run/hang-x")
    assert v.kind == "stuck" and v.culprits == [1]
    assert re.match(r"rank 1 \(host nid7, GCD 5\) is stuck in data for 33 s at iteration 4, not in a collective; "
                    r"1 rank waits for it: rank 0 in all_reduce #7 of group 2 during backward; Python stacks in "
                    r"/run/hang-x; every rank exits$", v.line), v.line
    assert v.dump == [1, 0] and v.records == [(1, "nid7", "stuck_rank")]


def test_two_blocked_pipelines_name_both_and_follow_waits_transitively():
    # PP=2 x DP=2: rank 0 never sends to rank 2; rank 3 never sends its gradient back to rank 1.
    ps = {0: pos(3, "send activation", None, {"p2p:0-2": 3}),
          1: pos(3, "recv grad", ("recv", "p2p:1-3", 5), {"p2p:1-3": 5}),
          2: pos(3, "recv activation", ("recv", "p2p:0-2", 4), {"p2p:0-2": 4}),
          3: pos(3, "backward", None, {"p2p:1-3": 4})}
    v = judge(ps, 4)
    assert v.culprits == [0, 3], v.line
    assert v.line.startswith("rank 0 (host h, GCD -) is stuck in send activation for 40 s at iteration 3")
    assert "also stuck: rank 3 (host h, GCD -) in backward" in v.line
    assert set(v.dump) == {0, 2, 3, 1}
    # A chain: rank 0 waits on rank 1 (world), rank 1 on rank 2 (TP group "5"), rank 2 computes: only 2 is named.
    chain = {0: pos(9, "log", ("all_reduce", "0", 30), {"0": 30}),
             1: pos(9, "forward", ("all_reduce", "5", 12), {"0": 29, "5": 12}),
             2: pos(9, "forward", None, {"0": 29, "5": 11})}
    assert judge(chain, 3).culprits == [2]


def test_every_rank_in_the_same_collective_is_a_collective_hang():
    ps = {r: pos(6, "backward", ("all_reduce", "0", 21), {"0": 21}, age=12.0 + r) for r in range(4)}
    v = judge(ps, 4)
    assert v.kind == "collective_hang" and not v.culprits
    assert v.line.startswith("collective hang: every rank in all_reduce #21 of the world group during backward "
                             "for 12 s at iteration 6"), v.line
    assert v.records == [(-1, "?", "collective_hang")] and v.dump == [0, 1, 3]
    # A sub-group whose collective never completes: the ranks waiting on it name its members.
    sub = {0: pos(2, "step end", ("all_reduce", "0", 8), {"0": 8, "5": 3}),
           1: pos(2, "step end", ("all_reduce", "0", 8), {"0": 8, "6": 3}),
           2: pos(2, "backward", ("all_reduce", "7", 4), {"0": 7, "7": 4}),
           3: pos(2, "backward", ("all_reduce", "7", 4), {"0": 7, "7": 4})}
    v = judge(sub, 4)
    assert v.culprits == [2, 3] and "stuck in all_reduce #4 of group 7 during backward" in v.line


def test_a_rank_that_does_not_answer_is_lost_and_a_failed_collective_is_said():
    v = judge({0: pos(5, "backward", ("all_reduce", "2", 9), {"2": 9}, err="Timed out waiting 15000ms for recv"),
               1: pos(5, "backward", ("all_reduce", "2", 9), {"2": 9})}, 3, missing=[2],
              hosts={2: ("nid9", "3")}, census_wait=7)
    assert v.kind == "lost" and v.culprits == [2]
    assert v.line.startswith("lost rank 2 (host nid9, GCD 3): it did not answer the hang census within 7 s")
    assert "(rank 0's all_reduce failed first: Timed out waiting 15000ms for recv)" in v.line
    assert v.records == [(2, "nid9", "lost_rank")]


def test_progress_moves_charge_phases_and_count_collectives_per_group():
    p = Progress()
    p.start_iteration(1)
    p.enter("forward")
    before = p.enter_collective("all_reduce", "3")
    assert p.position.collective == ("all_reduce", "3", 1) and p.where() == "all_reduce #1 of group 3 during forward"
    p.leave_collective(before)
    assert p.position.collective is None and p.position.phase == "forward"
    p.enter_collective("all_reduce", "3")
    p.collective_failed(RuntimeError("Timed out\nsecond line"))
    assert p.position.failed == "Timed out" and p.counts["3"] == 2
    assert p.times.get(COMM, 0) >= 0 and "forward" in p.times
    oom = RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried")
    assert is_out_of_memory(oom) and is_out_of_memory(MemoryError()) and not is_out_of_memory(RuntimeError("x"))
    assert describe_out_of_memory(oom, p).startswith("rank 0 (host ") and " ran out of host memory in all_reduce #2 " \
        "of group 3 during forward at iteration 1: [enforce fail" in describe_out_of_memory(oom, p)
