"""MoE settings: upstream's layer placement, the parameter and FLOP counts against the built model, and every bad
input as one line with exit code 2, before any process group."""

import pytest
import torch

import pretrain_gpt
from megatron.config import MoEConfig
from megatron.config.sizes import named_model
from megatron.core.parallel_state import GroupInfo
from megatron.errors import run_cli
from tests.models import CONFIG_GPT_L4

BASE = CONFIG_GPT_L4


def test_experts_per_layer_is_upstreams_placement():
    """upstream's get_num_experts_per_layer: layer n (1-based) is an MoE layer when n % interval == 0, with the one
    count or its own entry of the list."""
    assert MoEConfig(num_experts=(8,)).experts_per_layer(6) == [1, 8, 1, 8, 1, 8]
    assert MoEConfig(num_experts=(4, 8), expert_interval=3).experts_per_layer(6) == [1, 1, 4, 1, 1, 8]
    assert MoEConfig(num_experts=(4,), expert_interval=1).experts_per_layer(3) == [4, 4, 4]
    assert MoEConfig().experts_per_layer(4) == [1, 1, 1, 1] and not MoEConfig().enabled


@pytest.mark.parametrize("moe", [dict(num_experts=(4,)), dict(num_experts=(4, 2), topk=2, mlp_type="residual"),
                                 dict(num_experts=(4,), enable_expert_tensor_parallelism=True, mlp_type="residual")])
@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 2), (2, 4)])
def test_parameter_counts_are_the_built_models(moe, tp, ep):
    """The one formula (ModelConfig.layer_parameters / num_parameters) against what GPTModel builds: the whole model
    on one rank, and one layer's share on a TP x EP rank (groups without a process group: shapes only)."""
    from megatron.model.gpt_model import GPTModel

    cfg = named_model("debug", num_layers=4, use_cpu_initialization=True, moe=MoEConfig(**moe))
    lone = GroupInfo([0], 0, None)
    whole = GPTModel(cfg, tp=lone, init_seed=1)
    assert sum(p.numel() for p in whole.parameters()) == cfg.num_parameters()
    part = GPTModel(cfg, tp=GroupInfo(list(range(tp)), 0, None), init_seed=1, ep=GroupInfo(list(range(ep)), 0, None))
    for layer, n in zip(part.layers, cfg.layer_experts(), strict=True):
        assert sum(p.numel() for p in layer.parameters()) == cfg.layer_parameters(tp, n, ep)


def test_active_parameters_and_flops_count_the_routed_experts():
    from megatron.perf.flops import forward_flops_per_token

    dense = named_model("debug", num_layers=4)
    for k in (1, 2):
        cfg = dense.replace(moe=MoEConfig(num_experts=(8,), topk=k))
        gate = 8 * cfg.hidden_size
        assert cfg.num_parameters(active=True) == dense.num_parameters() + 2 * (gate + (k - 1) * cfg.mlp_parameters())
        assert cfg.num_parameters() == dense.num_parameters() + 2 * (gate + 7 * cfg.mlp_parameters())
        mlp_flops = 2 * cfg.hidden_size * cfg.ffn_hidden_size * 2
        assert forward_flops_per_token(cfg)[0] == forward_flops_per_token(dense)[0] + 2 * ((k - 1) * mlp_flops
                                                                                            + 2 * gate)


def _run(argv, monkeypatch, capsys, world_size):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world_size))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29556")
    rc = run_cli(pretrain_gpt.main, argv)
    return rc, capsys.readouterr().err.strip()


@pytest.mark.parametrize("extra, world, needles", [
    (["--num-experts", "3", "--moe-expert-parallel-size", "2"], 4, ["--num-experts 3", "--moe-expert-parallel-size 2"]),
    (["--num-experts", "3", "--moe-expert-parallel-size", "3"], 4, ["--moe-expert-parallel-size 3",
                                                                     "data-parallel size 4"]),
    (["--num-experts", "2", "--topk", "3"], 1, ["--topk 3", "2 experts"]),
    (["--num-experts", "4", "--moe-train-capacity-factor", "0"], 1, ["--moe-train-capacity-factor 0",
                                                                      "out of range"]),
    (["--num-experts", "4", "--moe-eval-capacity-factor", "-1"], 1, ["--moe-eval-capacity-factor -1"]),
    (["--num-experts", "4", "--zero-stage", "3", "--zero-hierarchy", "node,network"], 8, ["--zero-hierarchy",
                                                                                         "hierarchical ZeRO"]),
    (["--num-experts", "4", "--zero-stage", "3"], 1, ["--zero-stage 3", "ZeRO-3"]),
    (["--num-experts", "4", "--pipeline-model-parallel-size", "2", "--expert-interval", "4"], 2,
     ["--pipeline-model-parallel-size 2", "stage 0 (layers 0-1) has no layer with experts"]),
    (["--num-experts", "4", "--ds-sequence-parallel-size", "2"], 2, ["--ds-sequence-parallel-size 2"]),
    (["--num-experts", "4", "2", "8"], 1, ["--num-experts gives 3 counts", "2 MoE layers"]),
    (["--num-experts", "4", "--moe-min-capacity", "100"], 1, ["--moe-min-capacity 100", "64 tokens"]),
    (["--num-experts", "4", "--use-tutel"], 1, ["--use-tutel is refused", "Tutel"]),
    (["--num-experts-switch", "4"], 1, ["--num-experts-switch is refused", "--num-experts"]),
])
def test_bad_moe_input_is_one_line(extra, world, needles, monkeypatch, capsys):
    rc, err = _run(BASE + extra, monkeypatch, capsys, world)
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for n in needles:
        assert n in err, f"{n!r} missing from {err!r}"


def test_moe_flags_reach_the_config():
    from megatron.arguments import configure
    from megatron.tokenizer import FixedVocabulary

    run, _ = configure(BASE + ["--num-experts", "8", "--topk", "2", "--moe-expert-parallel-size", "2",
                               "--disable-moe-token-dropping", "--disable-moe-top2-2nd-expert-sampling",
                               "--mlp-type", "residual", "--moe-loss-coeff", "0.01", "--moe-min-capacity", "2",
                               "--enable-expert-tensor-parallelism", "--create-moe-param-group"], 4,
                       lambda data: FixedVocabulary(128, None))
    m = run.model.moe
    assert (m.num_experts, m.topk, m.moe_token_dropping, m.moe_top2_2nd_expert_sampling, m.mlp_type) == \
        ((8,), 2, False, False, "residual")
    assert (m.moe_loss_coeff, m.moe_min_capacity, m.enable_expert_tensor_parallelism, run.parallel.ep) == \
        (0.01, 2, True, 2)
    assert torch.tensor(m.experts_per_layer(4)).tolist() == [1, 8, 1, 8]
