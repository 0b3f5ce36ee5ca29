"""Pipeline partitioning, DeepSpeed's grid rank order vs parallel_state, refusals and the start-up report
(no processes: everything here is pure)."""

import json
from types import SimpleNamespace
from itertools import pairwise

import pytest
import torch
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from megatron.arguments.deepspeed_json import with_deepspeed_json
from megatron.config import OptimizerConfig, ParallelConfig, RunConfig, TrainingConfig
from megatron.config.moe import MoEConfig
from megatron.core.parallel_state import GroupInfo, ParallelState, layout_groups, single_process_state
from megatron.engine import build_ds_config
from megatron.errors import ConfigError
from megatron.model.gpt_model import GPTModel
from megatron.model.gpt_model_pipe import check_topology, partition, spec_kinds, stage_contents
from megatron.config.sizes import named_model
from megatron.training.layout_report import layout_report, model_features
from tests.models import GPT_H64


def _state(world, tp, pp, rank=0) -> ParallelState:
    groups = layout_groups(world, tp, pp)
    mine = {k: next(GroupInfo(g, g.index(rank)) for g in lists if rank in g) for k, lists in groups.items()}
    return ParallelState(world, rank, mine["tp"], mine["dp"], mine["pp"], mine["mp"], groups)


def _run(world=8, tp=2, pp=2, zero=1, layers=4, ds=None, **model):
    fields = dict(model=named_model("debug", num_layers=layers, **model),
                  parallel=ParallelConfig(world_size=world, tensor_model_parallel_size=tp,
                                          pipeline_model_parallel_size=pp, zero_stage=zero),
                  optimizer=OptimizerConfig(lr=1e-3), training=TrainingConfig(micro_batch_size=1, global_batch_size=8))
    return RunConfig(**with_deepspeed_json(fields, ds))


def test_even_split_by_transformer_layers():
    cfg = named_model("debug", num_layers=8)
    parts = partition(cfg, 4)
    assert parts == [0, 3, 5, 7, 11]  # embedding + 2 layers | 2 | 2 | 2 + norm + output
    assert stage_contents(cfg, parts) == ["embedding, layers 0-1", "layers 2-3", "layers 4-5",
                                          "layers 6-7, norm, output (tied)"]


def test_uneven_split_gives_the_remainder_to_the_first_stages():
    cfg = named_model("debug", num_layers=6, untie_embeddings_and_output_weights=True)
    contents = stage_contents(cfg, partition(cfg, 4))
    assert contents == ["embedding, layers 0-1", "layers 2-3", "layer 4", "layer 5, norm, output"]


def test_too_few_layers_is_refused_with_the_counts_that_work():
    with pytest.raises(ConfigError, match=r"--num-layers 3 .* 4 stages.*--num-layers >= 4.*multiple of 4"):
        partition(named_model("debug", num_layers=3), 4)


def test_standalone_embedding_stage_holds_the_embedding_alone():
    """--standalone-embedding-stage: stage 0 is the embedding, the layers split over the other stages (the remainder
    first); the memory and step-time models count the same split; other partitions refuse it; PP=1 ignores it."""
    from megatron.perf.layout import Layout
    from megatron.perf.memory import estimate_memory, estimate_stage_memory

    cfg = named_model("debug", num_layers=5)
    parts = partition(cfg, 3, standalone_embedding=True)
    assert parts == [0, 1, 4, 8]
    assert stage_contents(cfg, parts) == ["embedding", "layers 0-2", "layers 3-4, norm, output (tied)"]
    assert cfg.stage_layer_counts(3, True) == [0, 3, 2] and partition(cfg, 1, standalone_embedding=True) == [0, 8]
    with pytest.raises(ConfigError, match="--num-layers 1 cannot fill the 2 stages after the embedding's"):
        partition(named_model("debug", num_layers=1), 3, standalone_embedding=True)
    with pytest.raises(ConfigError, match="--standalone-embedding-stage with the 'uniform' pipeline partition"):
        partition(cfg, 3, "uniform", standalone_embedding=True)
    layout = Layout.of(pp=3, standalone_embedding_stage=True, global_batch_size=8)
    assert layout.stage_layers(5) == [0, 3, 2]
    first_layers = estimate_stage_memory(cfg, layout, 1)
    assert estimate_stage_memory(cfg, layout, 0).terms["activations"] == 0
    assert estimate_memory(cfg, layout).total == max(first_layers.total,
                                                     estimate_stage_memory(cfg, layout, 2).total)


def test_parameter_partition_balances_and_keeps_every_stage():
    cfg = named_model("gpt2-small", num_layers=12)
    parts = partition(cfg, 4, "parameters")
    assert parts[0] == 0 and parts[-1] == len(spec_kinds(cfg)) and all(b > a for a, b in pairwise(parts))
    layers = [sum(1 for k in spec_kinds(cfg)[a:b] if k == "layer") for a, b in pairwise(parts)]
    # The 38M-parameter embedding and output layer each weigh several 7M-parameter layers.
    assert layers[0] < 3 and layers[-1] < 3 and sum(layers) == 12
    with pytest.raises(ConfigError, match="choose one of"):
        partition(cfg, 4, "profile")


@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 2), (1, 4, 2), (4, 2, 1), (2, 1, 4)])
def test_deepspeed_grid_rank_order_matches_parallel_state(tp, pp, dp):
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    check_topology(topo, _state(tp * pp * dp, tp, pp))
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    assert topo.get_rank(pipe=pp - 1, data=dp - 1, model=tp - 1) == tp * pp * dp - 1


def test_zero2_with_pipeline_is_refused_with_the_alternatives():
    with pytest.raises(ConfigError, match="--zero-stage 1.*--no-pipeline-parallel"):
        _run(zero=2)
    assert build_ds_config(_run(pp=1, zero=2))["zero_optimization"]["stage"] == 2


def test_deepspeed_activation_checkpointing_keys(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"pipeline": {"activation_checkpoint_interval": 1},
                                "activation_checkpointing": {"number_checkpoints": 2}}))
    run = _run(ds=str(path))
    cfg = build_ds_config(run)
    # number_checkpoints only sizes DeepSpeed's contiguous buffer: every layer is still recomputed.
    assert run.model.recompute_granularity == "full" and run.model.recompute_num_layers is None
    assert any("number_checkpoints accepted, no effect" in n for n in cfg["megatron_notes"])
    assert cfg["pipeline"]["activation_checkpoint_interval"] == 0  # our layers checkpoint themselves
    path.write_text(json.dumps({"activation_checkpointing": {"partition_activations": True}}))
    run = _run(ds=str(path))
    assert run.model.recompute_partition  # honoured by our recompute (tests/distributed/test_recompute_partition)


def test_layout_report_lists_groups_stages_params_and_memory():
    text = layout_report(_run(layers=4), _state(8, 2, 2))
    assert "TP groups (4 of size 2): [0, 1] [2, 3] [4, 5] [6, 7]" in text
    assert "PP groups (4 of size 2): [0, 4] [1, 5] [2, 6] [3, 7]" in text
    assert "DP groups (4 of size 2): [0, 2] [1, 3] [4, 6] [5, 7]" in text
    assert "stage 0 (ranks 0,1,2,3): embedding, layers 0-1 |" in text
    assert "stage 1 (ranks 4,5,6,7): layers 2-3, norm, output (tied) |" in text
    assert text.count("params per GCD") == 2 and text.count("est. memory") == 2


def test_no_pipeline_parallel_with_pp_is_refused(monkeypatch):
    from pretrain_gpt import pretrain_from_flags
    from megatron.training.pretrain import Providers

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    argv = GPT_H64.flags() + ["--lr", "1e-3", "--train-iters", "1", "--pipeline-model-parallel-size", "2",
                              "--no-pipeline-parallel"]
    with pytest.raises(ConfigError, match="--no-pipeline-parallel with --pipeline-model-parallel-size 2"):
        pretrain_from_flags(argv, Providers(None, None, None, lambda data: SimpleNamespace(vocab_size=100, eod=None)))



@pytest.mark.parametrize("size,overrides,want", [
    ("debug", {"apply_layernorm_1p": True, "squared_relu": True, "apply_residual_connection_post_layernorm": True,
               "fp32_residual_connection": True, "embedding_weights_in_fp32": True},
     "layernorm-1p, squared-relu MLP, 4 heads (MHA), learned positions, fp32 embedding lookup, post-norm residuals, "
     "fp32 residual stream, tied output layer, linear biases")])
def test_model_features_line_names_upstreams_variants(size, overrides, want):
    model = GPTModel(named_model(size, use_cpu_initialization=True, **overrides), tp=single_process_state().tp)
    assert model_features(model) == "> model features: " + want


@pytest.mark.parametrize("size,overrides,want", [
    ("debug", {}, "layernorm, gelu MLP, 4 heads (MHA), learned positions, tied output layer, linear biases"),
    ("debug-llama", {"rotary_percent": 0.25}, "rmsnorm, swiglu MLP, rotary positions (4 of 16 dims per head), "
     "4 query heads over 2 KV heads (GQA), untied output layer, no linear biases"),
    ("debug", {"moe": MoEConfig(num_experts=(4,), expert_interval=1, topk=2, mlp_type="residual")},
     "layernorm, gelu MLP, 4 heads (MHA), learned positions, tied output layer, linear biases, "
     "2 MoE layers (4 experts, 4 on this rank of EP 1, top-2, PR-MoE)"),
])
def test_model_features_line_reads_the_built_modules(size, overrides, want):
    model = GPTModel(named_model(size, use_cpu_initialization=True, **overrides), tp=single_process_state().tp)
    assert model_features(model) == "> model features: " + want
    model.output_layer = torch.nn.Identity()  # what a first pipeline stage holds: no output layer
    assert "output layer on another stage" in model_features(model)


def test_moe_switches_pipe_partitioning_off_and_refuses_it_in_a_json(tmp_path):
    """Pipe/grad partitioning sends only the first tensor partitioned: with experts a stage sends two that need
    gradients (the hidden state and the MoE-loss sum)."""
    from megatron.config import MoEConfig

    moe = MoEConfig(num_experts=(4,))
    assert build_ds_config(_run(moe=moe))["pipeline"]["pipe_partitioned"] is False
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"pipeline": {"grad_partitioned": True}}))
    with pytest.raises(ConfigError, match="grad_partitioned=true, which cannot send the MoE loss"):
        build_ds_config(_run(moe=moe, ds=str(path)))
