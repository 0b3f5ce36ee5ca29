"""Pipeline parallelism (DeepSpeed's pipeline engine) against a single-process torch loop over 10 steps.

PP=4 and PP=2 x DP=2 for GPT-2 and Llama variants with tied and untied embeddings (fp32, <= 1e-5), under
ZeRO-0 (our clipping hook) and ZeRO-1 (DeepSpeed's clipping); then TP=2 x PP=2 x DP=2 with ZeRO-1 on
8 processes (<= 1e-4), once with sequence parallelism. Two runs also recompute activations inside the
stages. Clipping is active throughout, so a wrong grad norm would show.
"""

import pytest
import torch

from tests.launcher import run_distributed

STEPS, GBS, MBS, SEQ, VOCAB = 10, 8, 1, 16, 120
VARIANTS = {  # name -> (named model, untie)
    "gpt2-tied": ("debug", False),
    "gpt2-untied": ("debug", True),
    "llama-untied": ("debug-llama", True),
    "llama-tied": ("debug-llama", False),
}


def _run_config(variant, world, tp, pp, zero, recompute=None, sp=False):
    from megatron.config import OptimizerConfig, ParallelConfig, RunConfig, TrainingConfig
    from megatron.config.sizes import named_model

    name, untie = VARIANTS[variant]
    model = named_model(name, num_layers=4, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                        seq_length=SEQ, vocab_size=VOCAB, make_vocab_size_divisible_by=64,
                        untie_embeddings_and_output_weights=untie, recompute_granularity=recompute)
    return RunConfig(
        model=model,
        parallel=ParallelConfig(world_size=world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                zero_stage=zero, sequence_parallel=sp),
        optimizer=OptimizerConfig(lr=4e-3, min_lr=1e-3, lr_warmup_iters=2, clip_grad=0.5, weight_decay=0.1),
        training=TrainingConfig(micro_batch_size=MBS, global_batch_size=GBS, train_iters=STEPS, seed=5),
    ).validate()


def reference_losses(variant):
    """One process, no DeepSpeed (tests/reference.py)."""
    from tests.reference import reference_losses as plain

    return plain(_run_config(variant, 1, 1, 1, 0), STEPS, dataset_size=1000)


def _train_pipe(variant, tp, pp, zero, recompute=None, sp=False):
    import deepspeed.comm as dist

    from megatron.core.parallel_state import ParallelState
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.engine import build_ds_config, initialize_engine
    from megatron.model.gpt_model_pipe import GPTModelPipe
    from megatron.training.batches import microbatches
    from megatron.training.pipe_step import pipe_microbatches, pipe_train_step

    run = _run_config(variant, dist.get_world_size(), tp, pp, zero, recompute, sp)
    state = ParallelState.build(tp, pp)
    model = GPTModelPipe(run.model, state, sequence_parallel=run.parallel.sequence_parallel,
                         init_seed=run.training.seed)
    engine = initialize_engine(model, run, state, build_ds_config(run))
    data = pipe_microbatches(microbatches(MockGPTDataset(1000, SEQ, VOCAB, seed=9), 0, MBS, state.dp.rank,
                                          state.dp.size, "cpu"))
    losses, norms = [], []
    for _ in range(STEPS):
        res = pipe_train_step(engine, data)
        t = torch.tensor([res.loss])
        dist.all_reduce(t, group=state.dp.group)  # the DP-mean loss, as the log reports it
        losses.append(t.item() / state.dp.size)
        norms.append(res.grad_norm)
    return {"losses": losses, "norms": norms}


def _worker(runs):
    from megatron.initialize import initialize_distributed

    initialize_distributed("gloo")
    return {run: _train_pipe(*run) for run in runs}


def _check(results, refs, tol):
    for rank, res in enumerate(results):
        for run, out in res.items():
            ref = refs[run[0]]
            for step, (a, b) in enumerate(zip(out["losses"], ref, strict=True)):
                assert abs(a - b) <= tol * max(1.0, abs(b)), f"rank {rank} {run} step {step}: {a} vs {b}"
            assert all(n is not None and n > 0 for n in out["norms"]), (run, out["norms"])
    for ref in refs.values():  # the model must learn, or equal losses would prove little
        assert min(ref[5:]) < ref[0] - 0.05, ref


@pytest.mark.timeout(600)
def test_pp4_and_pp2_dp2_match_single_process():
    # (variant, tp, pp, zero[, recompute]): every variant at PP=4 and at PP=2 x DP=2, ZeRO-0 and ZeRO-1
    # alternating; plus one run with full activation recompute inside the pipeline stages.
    runs = [(v, 1, pp, (i + j) % 2) for i, v in enumerate(VARIANTS) for j, pp in enumerate((4, 2))]
    runs.append(("llama-tied", 1, 2, 1, "full"))
    refs = {v: reference_losses(v) for v in VARIANTS}
    _check(run_distributed(_worker, world_size=4, runs=runs), refs, tol=1e-5)


@pytest.mark.timeout(600)
def test_tp2_pp2_dp2_zero1_matches_single_process():
    # (variant, tp, pp, zero, recompute, sequence parallel)
    runs = [("gpt2-tied", 2, 2, 1, None, True), ("llama-untied", 2, 2, 1, "selective", False)]
    refs = {v: reference_losses(v) for v, *_ in runs}
    _check(run_distributed(_worker, world_size=8, runs=runs), refs, tol=1e-4)
