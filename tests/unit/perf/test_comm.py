"""Communication bytes per step against hand counts, and the link tier each group crosses."""

from __future__ import annotations

import pytest

from megatron.config import ModelConfig
from megatron.perf.comm import estimate_comm
from megatron.perf.layout import Layout
from megatron.perf.memory import stage_parameters
from megatron.topology import frontier_placement, group_tier, parallel_groups

M = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=8, seq_length=32, vocab_size=256)
S, H, L = 32, 64, 4


def layout(**kw) -> Layout:
    base = {"tp": 1, "pp": 1, "dp": 1, "micro_batch_size": 2, "global_batch_size": 8, "zero_stage": 0}
    return Layout.of(**(base | kw))


def by(est, group, op, phase=None):
    found = [c for c in est.collectives if c.group == group and c.op == op and (phase is None or c.phase == phase)]
    assert len(found) == 1, (group, op, phase, est.collectives)
    return found[0]


def test_tp_all_reduces_without_sp():
    lay = layout(tp=2)  # 4 micro-batches of 2 sequences
    est = estimate_comm(M, lay, 0)
    act = S * 2 * H * 2  # s x b x h in bf16
    layers = by(est, "tp", "all_reduce", "layers")
    assert (layers.calls, layers.payload_bytes, layers.group_size, layers.tier) == (4 * L * 4, act, 2, "package")
    assert layers.wire_bytes == pytest.approx(layers.calls * act * 2 * (2 - 1) / 2)  # ring: 2(n-1)/n
    assert by(est, "tp", "all_reduce", "embedding").calls == 4
    assert by(est, "tp", "all_reduce", "output layer").calls == 4
    # Vocab-parallel cross entropy: an fp32 MAX all-reduce of [b, s] and one all-reduce of [2, b, s].
    ce_max, ce_sum = by(est, "tp", "all_reduce", "cross entropy max"), by(est, "tp", "all_reduce", "cross entropy sum")
    assert (ce_max.calls, ce_max.payload_bytes, ce_sum.calls, ce_sum.payload_bytes) == (4, 4 * S * 2, 4, 8 * S * 2)
    assert sum(c.payload_per_step for c in est.collectives) == 4 * (4 * L + 2) * act + 4 * 12 * S * 2
    recompute = estimate_comm(M, layout(tp=2, recompute_granularity="full"), 0)
    assert by(recompute, "tp", "all_reduce", "layers").calls == 4 * L * 5  # forward replayed up to FC2


def test_tp_sequence_parallel_gathers_and_scatters():
    """Column-parallel layers keep their gathered input for backward (no re-gather): 4 AG + 4 RS per layer."""
    est = estimate_comm(M, layout(tp=4, sequence_parallel=True), 0)
    act = S * 2 * H * 2
    ag, rs = by(est, "tp", "all_gather", "layers"), by(est, "tp", "reduce_scatter", "layers")
    assert (ag.calls, rs.calls, ag.payload_bytes, ag.tier) == (4 * L * 4, 4 * L * 4, act, "node")
    assert ag.wire_bytes == pytest.approx(ag.calls * act * 3 / 4)  # (n-1)/n
    # Two LayerNorms (weight + bias) and two row-parallel biases: 6 gradient all-reduces of h per layer.
    norms = by(est, "tp", "all_reduce", "seq-par param grads")
    assert (norms.calls, norms.payload_bytes) == (4 * L * 6, H * 2)
    assert by(est, "tp", "all_reduce", "final norm grads").calls == 4 * 2
    assert by(est, "tp", "all_gather", "output layer").calls == 4
    assert by(est, "tp", "reduce_scatter", "output layer").calls == 4
    # The embedding all-reduces, then splits the sequence: its backward all-gathers.
    assert by(est, "tp", "all_reduce", "embedding").calls == 4
    assert by(est, "tp", "all_gather", "embedding").calls == 4
    recompute = estimate_comm(M, layout(tp=4, sequence_parallel=True, recompute_granularity="full"), 0)
    assert by(recompute, "tp", "all_gather", "layers").calls == 4 * L * 6  # forward's 2 AG replayed
    assert by(recompute, "tp", "reduce_scatter", "layers").calls == 4 * L * 5  # but not FC2's RS


def test_pp_sends_per_stage():
    lay = layout(pp=4, dp=2)  # 8 GCDs: stages are rank pairs {0,1} {2,3} {4,5} {6,7}; 2 micro-batches of 2
    act = S * 2 * H * 2
    first, middle, last = (estimate_comm(M, lay, i) for i in (0, 1, 3))
    assert by(first, "pp", "send", "activations").calls == 2
    assert not [c for c in first.collectives if c.phase == "gradients"]
    assert by(middle, "pp", "send", "activations").payload_bytes == act
    assert by(middle, "pp", "send", "gradients").calls == 2
    assert not [c for c in last.collectives if c.phase == "activations"]
    assert by(first, "pp", "send", "activations").tier == "node"  # rank 0 -> rank 2: another package
    assert by(first, "pp", "send", "activations").wire_bytes == 2 * act
    # Tied embeddings: first and last stage all-reduce the word-embedding gradient once per step.
    emb = by(first, "embedding", "all_reduce")
    assert (emb.calls, emb.payload_bytes, emb.group_size) == (1, 256 * H * 2, 2)
    assert not [c for c in middle.collectives if c.group == "embedding"]
    seq_par = estimate_comm(M, layout(tp=2, pp=2, dp=2, sequence_parallel=True), 0)
    assert by(seq_par, "pp", "send", "activations").payload_bytes == act / 2
    assert by(seq_par, "pp", "send", "activations").tier == "node"


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_dp_and_zero(zero):
    lay = layout(dp=8, global_batch_size=32, zero_stage=zero)  # 2 micro-batches per step
    est = estimate_comm(M, lay, 0)
    p = stage_parameters(M, lay, 0) * 2
    dp = [c for c in est.collectives if c.group == "dp"]
    total = sum(c.payload_per_step for c in dp)
    wire = sum(c.wire_bytes for c in dp)
    # ZeRO-1/2: DeepSpeed all-reduces gradient buckets (ZeRO-2 every micro-batch), all-gathers weights once.
    # ZeRO-3 on a small model keeps every gathered weight until backward: one all-gather per micro-batch.
    expected = {0: (p, 2 * p * 7 / 8), 1: (2 * p, 3 * p * 7 / 8), 2: (3 * p, 5 * p * 7 / 8),
                3: (4 * p, 4 * p * 7 / 8)}[zero]
    assert (total, wire) == pytest.approx(expected)
    assert all(c.tier == "node" and c.group_size == 8 for c in dp)


def test_tiers_follow_rank_order():
    # TP=8 fills a node, so every DP group has one member per node and crosses the network.
    est = estimate_comm(M, layout(tp=8, dp=2, global_batch_size=4), 0)
    assert by(est, "tp", "all_reduce", "layers").tier == "node"
    dp = by(est, "dp", "all_reduce")
    assert (dp.tier, dp.members_on_node) == ("network", 1)
    assert est.wire_bytes_by_tier()["network"] == pytest.approx(dp.wire_bytes)
    # hpZ: the backward all-gather stays inside the hpZ group (DP ranks 0-1 = one package at TP=1).
    # reuse distance 0: ZeRO-3 releases every weight after forward and re-gathers it in backward.
    z3 = estimate_comm(M, layout(dp=16, global_batch_size=32, zero_stage=3, zero_hpz_partition_size=2), 0,
                       zero3_reuse_distance=0)
    assert by(z3, "dp", "all_gather", "weights fwd").tier == "network"
    assert by(z3, "dp", "all_gather", "weights bwd").tier == "package"
    assert by(z3, "dp", "all_gather", "weights bwd").seconds < by(z3, "dp", "all_gather", "weights fwd").seconds


@pytest.mark.parametrize("tp, pp, dp", [(1, 8, 2), (2, 4, 4), (4, 2, 4), (8, 2, 2), (2, 1, 16)])
def test_tiers_agree_with_topology(tp, pp, dp):
    """comm.py's fast tier arithmetic gives the same answer as megatron.topology's placement tables."""
    placements = frontier_placement(tp * pp * dp)
    groups = parallel_groups(tp * pp * dp, tp, pp)
    lay = layout(tp=tp, pp=pp, dp=dp, global_batch_size=2 * dp)
    for stage in range(pp):
        est = estimate_comm(M, lay, stage)
        me = stage * dp * tp
        for kind, name in (("tp", "tp"), ("dp", "dp")):
            group = next(g for g in groups[kind] if me in g)
            for c in est.collectives:
                if c.group == name and len(group) == c.group_size and c.phase != "weights bwd":
                    assert c.tier == group_tier(group, placements)
        for c in est.collectives:
            if c.group == "pp":
                peer = me + (dp * tp if c.phase == "activations" else -dp * tp)
                assert c.tier == group_tier([me, peer], placements)
