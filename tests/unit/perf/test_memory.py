"""Memory model terms against hand-computed values (ZeRO paper states, Korthikanti et al. activations)."""

from __future__ import annotations

import pytest

from megatron.config import ModelConfig
from megatron.errors import ConfigError
from megatron.config.sizes import named_model
from megatron.perf.layout import Layout
from megatron.perf.memory import (
    GIB,
    activation_bytes_per_layer,
    estimate_memory,
    estimate_stage_memory,
    stage_parameters,
)

# 4 layers, h=64, 4 heads, s=32, vocab 256 (no padding needed), GPT-2 style (biases, LayerNorm, tied embeddings).
SMALL = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 256}
# Per layer by hand: QKV 64*192+192, proj 64*64+64, fc1 64*256+256, fc2 256*64+64, 2 LayerNorms 2*(64+64).
LAYER = 12480 + 4160 + 16640 + 16448 + 256
TOTAL = 4 * LAYER + 256 * 64 + 32 * 64 + 128  # layers + word and position embeddings + final LayerNorm


def layout(**kw) -> Layout:
    base = {"tp": 1, "pp": 1, "dp": 4, "micro_batch_size": 1, "global_batch_size": 8, "zero_stage": 0}
    return Layout.of(**(base | kw))


def test_parameter_counts_by_hand():
    m = ModelConfig(**SMALL)
    assert m.layer_parameters() == LAYER == 49984
    assert stage_parameters(m, layout(), 0) == TOTAL == m.num_parameters()
    # PP=4: the last stage holds a copy of the tied word embeddings (Megatron), the first the real one.
    lay = layout(pp=4, dp=1)
    per_stage = [stage_parameters(m, lay, i) for i in range(4)]
    assert per_stage[1] == per_stage[2] == LAYER
    assert sum(per_stage) == TOTAL + 256 * 64
    # TP=2 shards the matrices and column-parallel biases; row-parallel biases and norms stay whole.
    assert m.layer_parameters(2) == (12480 + 4096 + 16640 + 16384) // 2 + 2 * 64 + 256


@pytest.mark.parametrize("zero, w, g, o", [(0, 2, 2, 12), (1, 2, 2, 3), (2, 2, 0.5, 3), (3, 0.5, 0.5, 3)])
def test_zero_stages_shard_states_over_dp(zero, w, g, o):
    """Bytes per parameter with DP=4: ZeRO-1 shards optimizer states, ZeRO-2 + gradients, ZeRO-3 + weights."""
    m = ModelConfig(**SMALL)
    t = estimate_memory(m, layout(zero_stage=zero), overhead_bytes=0).terms
    assert t["weights"] == pytest.approx(w * TOTAL)
    assert t["gradients"] == pytest.approx(g * TOTAL)
    assert t["optimizer_states"] == pytest.approx(o * TOTAL)
    # A small stage is far under DeepSpeed's reuse distance: ZeRO-3 keeps all of it gathered through backward.
    assert t["zero3_gathered"] == (2 * TOTAL if zero == 3 else 0)


def test_zero3_keeps_half_the_reuse_distance_gathered_on_big_stages():
    m = named_model("gpt-175b")
    lay = layout(tp=8, dp=128, global_batch_size=1024, zero_stage=3)
    t = estimate_memory(m, lay, overhead_bytes=0).terms
    assert t["zero3_gathered"] == pytest.approx((0.5e9 + 2 * m.layer_parameters(8)) * 2)


def test_fp32_states_and_overhead():
    m = ModelConfig(**SMALL)
    est = estimate_memory(m, layout(dtype="fp32"), overhead_bytes=123)
    assert (est.terms["weights"], est.terms["gradients"], est.terms["optimizer_states"]) == (4 * TOTAL, 4 * TOTAL,
                                                                                            8 * TOTAL)
    assert est.terms["framework_overhead"] == 123
    # DeepSpeed's ZeRO optimizers keep an fp32 copy of the partition even for fp32 weights: 12 bytes / DP.
    z1 = estimate_memory(m, layout(dtype="fp32", zero_stage=1), overhead_bytes=0)
    assert z1.terms["optimizer_states"] == pytest.approx(12 * TOTAL / 4)
    assert est.total == pytest.approx(sum(est.terms.values()))


def korthikanti(s, b, h, a, t, seq_par=False, selective=False):
    """The paper's per-layer formulas (bytes, 16-bit activations), typed in from Section 4 / Table 2."""
    if seq_par and selective:
        return s * b * h * 34 / t
    if seq_par:
        return s * b * h / t * (34 + 5 * a * s / h)
    if selective:
        return s * b * h * (10 + 24 / t)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("seq_par", [False, True])
def test_activations_match_korthikanti(t, seq_par):
    m = named_model("gpt-22b")
    s, b, h, a = 2048, 2, 6144, 48
    kw = {"tp": t, "dp": 1, "micro_batch_size": b, "global_batch_size": b, "sequence_parallel": seq_par}
    no_flash = activation_bytes_per_layer(m, layout(flash_attention=False, **kw))
    assert no_flash == pytest.approx(korthikanti(s, b, h, a, t, seq_par=seq_par and t > 1))
    selective = activation_bytes_per_layer(m, layout(recompute_granularity="selective", **kw))
    assert selective == pytest.approx(korthikanti(s, b, h, a, t, seq_par=seq_par and t > 1, selective=True))
    # Flash attention keeps only an fp32 log-sum-exp per query row instead of the s x s tensors.
    flash = activation_bytes_per_layer(m, layout(**kw))
    assert flash == pytest.approx(selective + 4 * a * s * b / t)


def test_full_recompute_keeps_layer_inputs_only():
    m = named_model("gpt-22b")
    lay = layout(tp=2, pp=1, dp=1, global_batch_size=4, recompute_granularity="full", sequence_parallel=True)
    act = estimate_stage_memory(m, lay, 0).terms["activations"]
    per_layer_full = activation_bytes_per_layer(m, lay)
    assert act == pytest.approx(48 * 2048 * 6144 * 2 / 2 + per_layer_full)


def test_first_stage_holds_pp_microbatches_and_is_the_worst():
    m = named_model("gpt-22b")
    per_layer = activation_bytes_per_layer(m, layout(pp=8, dp=2, global_batch_size=640))
    for gbs, in_flight in ((640, 8), (6, 3)):  # 320 micro-batches -> pp in flight; 3 -> all 3
        lay = layout(pp=8, dp=2, global_batch_size=gbs)
        first = estimate_stage_memory(m, lay, 0)
        assert first.terms["activations"] == pytest.approx(6 * per_layer * in_flight)
        assert estimate_stage_memory(m, lay, 7).terms["activations"] == pytest.approx(6 * per_layer)
        assert estimate_stage_memory(m, lay, 7).terms["logits"] > 0 and first.terms["logits"] == 0
        worst = estimate_memory(m, lay)
        assert worst.total == max(estimate_stage_memory(m, lay, i).total for i in range(8))
    assert estimate_memory(m, layout(pp=8, dp=2, global_batch_size=640)).stage == 0


def test_22b_at_the_ornl_layout_fits_and_full_model_on_one_gcd_does_not():
    m = named_model("gpt-22b")
    ornl = estimate_memory(m, layout(pp=8, dp=2, global_batch_size=640, zero_stage=1, recompute_granularity="full"))
    assert ornl.fits() and 20 * GIB < ornl.total < 64 * GIB
    assert not estimate_memory(m, layout(dp=1, global_batch_size=1)).fits()  # 22B x 16 bytes = 330 GB


def test_layout_checks():
    with pytest.raises(ConfigError, match="pipeline engine"):
        layout(pp=2, zero_stage=2)
    with pytest.raises(ConfigError, match="--global-batch-size"):
        layout(global_batch_size=6)
    with pytest.raises(ConfigError, match="hpz"):
        layout(zero_hpz_partition_size=2)
    assert layout(tp=1, sequence_parallel=True).sequence_parallel is False
    lay = layout(tp=2, pp=2, dp=2, global_batch_size=16, micro_batch_size=2)
    assert (lay.world_size, lay.num_microbatches) == (8, 4)
    with pytest.raises(ConfigError, match="--num-attention-heads"):
        layout(tp=8, dp=1).validate_for(ModelConfig(**SMALL))
