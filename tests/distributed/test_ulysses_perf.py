"""DeepSpeed-Ulysses in the performance model against gloo runs (tests/distributed/ulysses_probe.py): the planner's
all-to-all bytes equal what comm.all_to_all sends, and each rank's saved activations fall as 1/SP. One set of 4
processes measures both (module fixture)."""

import pytest

from tests.distributed.ulysses_probe import measure
from tests.launch import run_distributed

STEPS = 2
CONFIGS = [{"tp": 1, "ulysses": 4, "recompute": "full"}, {"tp": 2, "ulysses": 2}]
SAVED_KW = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 256, "vocab_size": 256}


@pytest.fixture(scope="module")
def measured():
    return run_distributed(measure, world_size=4, configs=CONFIGS, ulysses_sizes=[1, 2, 4], model_kw=SAVED_KW,
                           steps=STEPS)


@pytest.mark.timeout(600)
def test_planner_all_to_all_bytes_equal_a_gloo_run(measured):
    from megatron.perf.comm import estimate_comm
    from megatron.perf.layout import Layout
    from tests.distributed.test_ulysses import MBS, _model_cfg

    model = _model_cfg("debug-llama")
    for i, cfg in enumerate(CONFIGS):
        dp = 4 // (cfg["tp"] * cfg["ulysses"])
        layout = Layout.of(tp=cfg["tp"], pp=1, dp=dp, micro_batch_size=MBS, global_batch_size=2 * MBS * dp,
                           zero_stage=1, ds_sequence_parallel_size=cfg["ulysses"], dtype="fp32",
                           recompute_granularity=cfg.get("recompute"))
        collectives = estimate_comm(model, layout).collectives
        predicted = STEPS * sum(c.payload_per_step for c in collectives if c.group == "ulysses")
        for rank, (sent, _) in enumerate(measured):
            assert sent[i] == predicted, f"rank {rank} {cfg}: measured {sent[i]} B, planner {predicted} B"
        assert predicted > 0


@pytest.mark.timeout(600)
def test_saved_activations_per_rank_fall_as_one_over_sp(measured):
    for rank, (_, got) in enumerate(measured):
        for u in (2, 4):
            ratio = got[u] / got[1]
            assert abs(ratio - 1 / u) <= 0.1 / u, f"rank {rank} SP={u}: {got[u]} / {got[1]} = {ratio:.3f}"
