"""ZeRO-1/2/3 with DP=2, and TP=2 x DP=2 under ZeRO-2, against a plain single-process torch loop."""

import pytest
import torch

from tests.launch import run_distributed

STEPS, GBS, MBS = 10, 4, 1


def _run_config(dp, tp, zero, wd_style="linear", wd_start=0.1, wd_end=1.0):
    from megatron.config import OptimizerConfig, ParallelConfig, RunConfig, TrainingConfig
    from megatron.config.sizes import named_model

    model = named_model("debug", use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                        seq_length=16, vocab_size=120, make_vocab_size_divisible_by=64)
    return RunConfig(
        model=model,
        parallel=ParallelConfig(world_size=dp * tp, tensor_model_parallel_size=tp, zero_stage=zero),
        # lr and clip chosen so that clipping is active: a wrong TP grad-norm would show. The weight decay ramps
        # (--weight-decay-incr-style linear 0.1 -> 1.0): a layout whose optimizer missed the schedule's decay
        # would show too (test_the_weight_decay_ramp_is_visible_in_the_losses).
        optimizer=OptimizerConfig(lr=4e-3, min_lr=1e-3, lr_warmup_iters=2, clip_grad=0.5,
                                  weight_decay_incr_style=wd_style, start_weight_decay=wd_start,
                                  end_weight_decay=wd_end, weight_decay=0.1),
        training=TrainingConfig(micro_batch_size=MBS, global_batch_size=GBS, train_iters=STEPS, seed=5),
    )


def reference_losses():
    """Single process, no DeepSpeed (tests/reference.py)."""
    from tests.reference import reference_losses as plain

    return plain(_run_config(1, 1, 0), STEPS, dataset_size=1000)


def _train(tp, zero):
    import deepspeed.comm as dist

    from megatron.core.parallel_state import ParallelState
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.engine import build_ds_config, initialize_engine
    from megatron.model.gpt_model import GPTModel
    from megatron.training.batches import microbatches
    from megatron.training.step import train_step

    world = dist.get_world_size()
    run = _run_config(world // tp, tp, zero)
    state = ParallelState.build(tp)
    model = GPTModel(run.model, tp=state.tp, init_seed=run.training.seed)
    ds = build_ds_config(run)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # really partition tiny params
    engine = initialize_engine(model, run, state, ds)
    data = microbatches(MockGPTDataset(1000, 16, 120, seed=9), 0, MBS, state.dp.rank, state.dp.size, "cpu")
    gas = run.training.grad_accumulation_steps(state.dp.size)
    losses = []
    for _ in range(STEPS):
        res = train_step(engine, data, gas)
        t = torch.tensor([res.loss])
        dist.all_reduce(t, group=state.dp.group)  # the DP-mean loss, as the log reports it
        losses.append(t.item() / state.dp.size)
    return losses


def _worker(stages, tp):
    from megatron.initialize import initialize_distributed

    initialize_distributed("gloo")
    return {z: _train(tp, z) for z in stages}


def test_the_weight_decay_ramp_is_visible_in_the_losses():
    """The ramped decay moves the reference losses well beyond _check's tolerance from a constant 0.1, so a
    layout that kept the constant decay (or none) fails there."""
    from tests.reference import reference_losses as plain

    const = plain(_run_config(1, 1, 0, "constant", None, None), STEPS, dataset_size=1000)
    ramp = reference_losses()
    assert max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(ramp, const, strict=True)) > 5e-5


def _check(results, ref, tol=1e-5):
    for rank, res in enumerate(results):
        for stage, losses in res.items():
            for step, (a, b) in enumerate(zip(losses, ref, strict=True)):
                assert abs(a - b) <= tol * max(1.0, abs(b)), f"rank {rank} ZeRO-{stage} step {step}: {a} vs {b}"
    # The model must actually learn something, or equal losses would prove little.
    assert min(ref[5:]) < ref[0] - 0.05, ref


@pytest.mark.timeout(900)
def test_zero_123_dp2_match_single_process():
    ref = reference_losses()
    _check(run_distributed(_worker, world_size=2, stages=(1, 2, 3), tp=1), ref)


@pytest.mark.timeout(900)
def test_tp2_dp2_zero2_matches_single_process():
    ref = reference_losses()
    _check(run_distributed(_worker, world_size=4, stages=(2,), tp=2), ref)
