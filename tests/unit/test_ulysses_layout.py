"""DeepSpeed-Ulysses without processes: rank groups, the loader's sequence slices, and the one-line refusals."""

import pytest
import torch

from megatron.errors import ConfigError


def test_sp_groups_split_the_data_parallel_dimension():
    from megatron.topology import parallel_groups

    g = parallel_groups(16, 2, 2, 2)  # TP=2, PP=2, SP=2, DP=2: the worked example in parallel_state.py
    assert g["ulysses"] == [[0, 2], [4, 6], [1, 3], [5, 7], [8, 10], [12, 14], [9, 11], [13, 15]]
    assert g["dp"] == [[0, 4], [2, 6], [1, 5], [3, 7], [8, 12], [10, 14], [9, 13], [11, 15]]
    assert g["ulysses_dp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert parallel_groups(16, 2, 2)["dp"] == g["ulysses_dp"]  # SP x DP is exactly the old DP dimension
    for kind in ("ulysses", "dp"):  # every rank exactly once
        assert sorted(r for grp in g[kind] for r in grp) == list(range(16))


def test_slices_rebuild_tokens_labels_and_mask():
    from megatron.core.parallel_state import GroupInfo
    from megatron.core.ulysses import slice_batch

    text = torch.arange(2 * 17).reshape(2, 17)
    mask = torch.rand(2, 16)
    parts = [slice_batch({"text": text, "loss_mask": mask}, GroupInfo([0, 1, 2, 3], j)) for j in range(4)]
    assert torch.equal(torch.cat([p["text"][:, :-1] for p in parts], 1), text[:, :-1])  # inputs
    assert torch.equal(torch.cat([p["text"][:, 1:] for p in parts], 1), text[:, 1:])  # labels
    assert torch.equal(torch.cat([p["loss_mask"] for p in parts], 1), mask)


def _run(world, ulysses, **model):
    from megatron.config import ParallelConfig, RunConfig, TrainingConfig
    from megatron.config.sizes import named_model

    return RunConfig(model=named_model("debug-llama", **model),
                     parallel=ParallelConfig(world_size=world, ds_sequence_parallel_size=ulysses),
                     training=TrainingConfig())


@pytest.mark.parametrize("world,ulysses,model,needle", [
    (4, 4, {}, "--num-key-value-heads 2"),  # GQA: 2 KV heads cannot go to 4 SP ranks
    (4, 4, {"num_attention_heads": 2, "num_key_value_heads": 2}, "--num-attention-heads 2"),
    (2, 2, {"seq_length": 33}, "--seq-length 33"),
    (3, 2, {}, "world size 3"),
])
def test_unsplittable_layouts_are_refused_in_one_line(world, ulysses, model, needle):
    with pytest.raises(ConfigError) as e:
        _run(world, ulysses, **model)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg


def test_sp_with_pipeline_validates_and_sp_divides_the_pipeline_sends():
    from megatron.config import ParallelConfig, RunConfig
    from megatron.config.sizes import named_model
    from megatron.perf.comm import estimate_comm
    from megatron.perf.layout import Layout

    run = RunConfig(model=named_model("debug"), parallel=ParallelConfig(
        world_size=8, pipeline_model_parallel_size=2, ds_sequence_parallel_size=2))
    assert (run.parallel.dp, run.parallel.ulysses) == (2, 2)

    def sends(u):
        layout = Layout.of(tp=1, pp=2, dp=2, micro_batch_size=1, global_batch_size=4, zero_stage=1,
                           ds_sequence_parallel_size=u)
        return sum(c.payload_per_step for c in estimate_comm(run.model, layout).collectives if c.group == "pp")

    assert sends(2) == sends(1) / 2


def test_dp_excludes_sp_and_the_flag_reaches_the_config():
    from megatron.arguments import parse_args, run_config_from_args

    args = parse_args(["--model-size", "debug", "--lr", "1e-3", "--train-iters", "1", "--global-batch-size", "4",
                       "--ds-sequence-parallel-size", "2"])
    run = run_config_from_args(args, world_size=8, vocab_size=256)
    assert (run.parallel.ulysses, run.parallel.dp) == (2, 4)
    assert run.training.grad_accumulation_steps(run.parallel.dp) == 1


def test_hierarchical_zero_with_sp_is_refused_in_one_line():
    from megatron.config import ParallelConfig, RunConfig, TrainingConfig
    from megatron.config.sizes import named_model

    with pytest.raises(ConfigError, match="hierarchical ZeRO") as e:
        RunConfig(model=named_model("debug"), parallel=ParallelConfig(
            world_size=8, ds_sequence_parallel_size=2, zero_stage=3, zero_hierarchy="node,network"),
            training=TrainingConfig())
    assert "\n" not in str(e.value)


def test_memory_model_and_planner_have_the_sp_dimension():
    from megatron.config.sizes import named_model
    from megatron.perf.layout import Layout
    from megatron.perf.memory import estimate_memory
    from megatron.perf.planner import SearchSpace, enumerate_layouts

    model = named_model("llama-7b", seq_length=32768)

    def acts(u):
        layout = Layout.of(tp=1, pp=1, dp=8 // u, micro_batch_size=1, global_batch_size=8 // u, zero_stage=3,
                           ds_sequence_parallel_size=u)
        t = estimate_memory(model, layout).terms
        return t["activations"] + t["embedding_activations"] + t["logits"]

    assert acts(2) == pytest.approx(acts(1) / 2) and acts(8) == pytest.approx(acts(1) / 8)
    layouts = enumerate_layouts(model, 16, 16, SearchSpace(ds_sequence_parallel_size=(1, 2, 4, 8, 16)))
    sizes = {(lay.tp, lay.ulysses) for lay in layouts}
    assert (1, 16) in sizes and (2, 8) in sizes and (4, 8) not in sizes  # TP 4 x SP 8 would need 32 GCDs
    assert any(lay.pp > 1 for lay in layouts if lay.ulysses > 1)
    assert all(lay.world_size == 16 for lay in layouts)
