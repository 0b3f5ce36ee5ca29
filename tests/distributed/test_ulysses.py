"""DeepSpeed-Ulysses (--ds-sequence-parallel-size) against the single-process model: loss and every gradient
for SP=2, SP=4, TP=2 x SP=2 (with and without Megatron's --sequence-parallel), GPT-2 (learned positions) and
Llama (RoPE, GQA); then training runs on DeepSpeed's engine on 4 ranks: SP=2 x DP=2 under ZeRO-0/2/3 (selective
recompute with ZeRO-2), SP=4 under ZeRO-1 with full recompute, TP=2 x SP=2 under ZeRO-1 and ZeRO-3; PP=2 x SP=2
on the pipeline engine (ZeRO-0 tied GPT-2, ZeRO-1 Llama)."""

import pytest
import torch

from tests.launch import run_distributed

TOL = 1e-5
STEPS, GBS, MBS, SEQ = 6, 4, 1, 16
PIPE_STEPS = 4


def _model_cfg(variant):
    from megatron.config.sizes import named_model

    cfg = named_model(variant, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                      seq_length=SEQ, vocab_size=250, make_vocab_size_divisible_by=64)
    if cfg.swiglu:  # GQA, 2 query heads per KV head, 4 KV heads: TP=2 x SP=2 leaves one KV head per rank
        cfg = cfg.replace(num_attention_heads=8, num_key_value_heads=4)
    return cfg


def _compare_model(variant, tp_size, ulysses_size, sequence_parallel):
    from megatron.core import comm
    from megatron.core.parallel_state import GroupInfo, ParallelState
    from megatron.core.ulysses import slice_batch
    from megatron.model.gpt_model import GPTModel
    from megatron.training.step import gpt_forward_step
    from tests.distributed.test_tensor_parallel import _shard

    cfg = _model_cfg(variant)
    state = ParallelState.build(tp_size, ulysses_size=ulysses_size)
    ref = GPTModel(cfg, tp=GroupInfo([0], 0, None), init_seed=7)
    par = GPTModel(cfg, tp=state.tp, sequence_parallel=sequence_parallel, init_seed=7, ulysses=state.ulysses)
    gen = torch.Generator().manual_seed(3)
    batch = {"text": torch.randint(0, cfg.vocab_size, (2, SEQ + 1), generator=gen),
             "loss_mask": (torch.rand(2, SEQ, generator=gen) > 0.3).float()}
    loss_ref = gpt_forward_step(ref, batch)
    loss_par = gpt_forward_step(par, slice_batch(batch, state.ulysses))
    loss_ref.backward()
    loss_par.backward()
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in par.named_parameters():
        grad = comm.all_reduce(p.grad.clone(), state.ulysses.group)  # what DeepSpeed's SP x DP reduction sums
        g_ref = _shard(ref_params[name].grad, p, state.tp)
        worst = max(worst, (grad - g_ref).abs().max().item() / max(1.0, g_ref.abs().max().item()))
    return {"loss": abs(loss_ref.item() - loss_par.item()), "grad": worst, "nparams": len(ref_params)}


def _model_worker():
    from megatron.initialize import initialize_distributed

    initialize_distributed("gloo")
    out = {}
    for variant in ("debug", "debug-llama"):
        for tp, ulysses, seq_par in ((1, 2, False), (1, 4, False), (2, 2, False), (2, 2, True)):
            out[(variant, tp, ulysses, seq_par)] = _compare_model(variant, tp, ulysses, seq_par)
    return out


@pytest.mark.timeout(600)
def test_sp2_sp4_tp2sp2_loss_and_grads_match_single_process():
    results = run_distributed(_model_worker, world_size=4)
    for rank, res in enumerate(results):
        for key, errs in res.items():
            for what in ("loss", "grad"):
                assert errs[what] <= TOL, f"rank {rank} {key}: {what} differs by {errs[what]:.3e}"
    assert results[0][("debug-llama", 2, 2, True)]["nparams"] > 10


def _run_config(world, ulysses, zero, recompute=None, tp=1):
    from megatron.config import OptimizerConfig, ParallelConfig, RunConfig, TrainingConfig

    model = _model_cfg("debug-llama").replace(recompute_granularity=recompute)
    return RunConfig(
        model=model,
        parallel=ParallelConfig(world_size=world, ds_sequence_parallel_size=ulysses, zero_stage=zero,
                                tensor_model_parallel_size=tp),
        # clip 0.5 is active: a gradient norm off by the SP factor would change the losses
        optimizer=OptimizerConfig(lr=4e-3, min_lr=1e-3, lr_warmup_iters=2, clip_grad=0.5, weight_decay=0.1),
        training=TrainingConfig(micro_batch_size=MBS, global_batch_size=GBS, train_iters=STEPS, seed=5),
    )


def _train(ulysses, zero, recompute=None, tp=1):
    import deepspeed.comm as dist

    from megatron.core.parallel_state import ParallelState
    from megatron.core.ulysses import sequence_slices
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.engine import build_ds_config, initialize_engine
    from megatron.model.gpt_model import GPTModel
    from megatron.training.batches import microbatches
    from megatron.training.step import train_step

    run = _run_config(dist.get_world_size(), ulysses, zero, recompute, tp)
    state = ParallelState.build(tp, ulysses_size=ulysses)
    model = GPTModel(run.model, tp=state.tp, init_seed=run.training.seed, ulysses=state.ulysses)
    ds = build_ds_config(run)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # really partition tiny params
    engine = initialize_engine(model, run, state, ds)
    data = sequence_slices(microbatches(MockGPTDataset(1000, SEQ, 250, seed=9), 0, MBS, state.dp.rank,
                                        state.dp.size, "cpu"), state.ulysses)
    gas = run.training.grad_accumulation_steps(state.dp.size)
    losses, norms = [], []
    for _ in range(STEPS):
        res = train_step(engine, data, gas)
        t = torch.tensor([res.loss])
        dist.all_reduce(t, group=state.dp.group)  # the DP-mean loss, as the log reports it
        losses.append(t.item() / state.dp.size)
        norms.append(float(res.grad_norm))
    return losses, norms


def _train_worker(runs):
    from megatron.initialize import initialize_distributed

    initialize_distributed("gloo")
    return {r: _train(*r) for r in runs}


def _check_run(rank, run, got, ref, norm_tol=1e-4):
    """Losses within TOL and pre-clip gradient norms within ``norm_tol`` of the single-process run."""
    (losses, norms), (ref_losses, ref_norms) = got, ref
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= TOL * max(1.0, abs(b)), f"rank {rank} run {run} step {step}: loss {a} vs {b}"
    for step, (a, b) in enumerate(zip(norms, ref_norms, strict=True)):
        assert abs(a - b) <= norm_tol * b, f"rank {rank} run {run} step {step}: grad norm {a} vs {b}"


@pytest.mark.timeout(900)
def test_sp2_dp2_zero0_zero3_recompute_train_like_single_process():
    from tests.reference import reference_losses_and_norms

    ref = reference_losses_and_norms(_run_config(1, 1, 0), STEPS, dataset_size=1000)
    runs = ((2, 0), (2, 3), (4, 1, "full"), (2, 2, "selective"), (2, 1, None, 2), (2, 3, None, 2))  # SP, ZeRO, rc, TP
    results = run_distributed(_train_worker, world_size=4, runs=runs)
    for rank, res in enumerate(results):
        for r, got in res.items():
            _check_run(rank, r, got, ref)
    assert min(ref[0][3:]) < ref[0][0] - 0.02, ref  # it learns, so equal losses mean something


def _train_pipe(variant, zero):
    """PP=2 x SP=2 on DeepSpeed's pipeline engine (its grid's data axis is SP x DP)."""
    import deepspeed.comm as dist

    from megatron.core.parallel_state import ParallelState
    from megatron.core.ulysses import sequence_slices
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.engine import build_ds_config, initialize_engine
    from megatron.model.gpt_model_pipe import GPTModelPipe
    from megatron.training.batches import microbatches
    from megatron.training.pipe_step import pipe_microbatches, pipe_train_step

    run = _pipe_run_config(variant, dist.get_world_size(), pp=2, ulysses=2, zero=zero)
    state = ParallelState.build(1, 2, ulysses_size=2)
    model = GPTModelPipe(run.model, state, init_seed=run.training.seed)
    engine = initialize_engine(model, run, state, build_ds_config(run))
    data = pipe_microbatches(sequence_slices(microbatches(MockGPTDataset(1000, SEQ, 250, seed=9), 0, MBS,
                                                          state.dp.rank, state.dp.size, "cpu"), state.ulysses))
    steps = [pipe_train_step(engine, data) for _ in range(PIPE_STEPS)]
    return [r.loss for r in steps], [float(r.grad_norm) for r in steps]


def _pipe_run_config(variant, world, pp, ulysses, zero):
    from megatron.config import OptimizerConfig, ParallelConfig, RunConfig, TrainingConfig

    return RunConfig(
        model=_model_cfg(variant).replace(num_layers=4),
        parallel=ParallelConfig(world_size=world, pipeline_model_parallel_size=pp, ds_sequence_parallel_size=ulysses,
                                zero_stage=zero),
        optimizer=OptimizerConfig(lr=4e-3, min_lr=1e-3, lr_warmup_iters=2, clip_grad=0.5, weight_decay=0.1),
        training=TrainingConfig(micro_batch_size=MBS, global_batch_size=GBS, train_iters=PIPE_STEPS, seed=5),
    )


def _pipe_worker(runs):
    from megatron.initialize import initialize_distributed

    initialize_distributed("gloo")
    return {r: _train_pipe(*r) for r in runs}


@pytest.mark.timeout(900)
def test_pp2_sp2_pipeline_engine_trains_like_single_process():
    from tests.reference import reference_losses_and_norms

    runs = (("debug", 0), ("debug-llama", 1))  # tied embeddings + learned positions; untied + RoPE + GQA
    refs = {v: reference_losses_and_norms(_pipe_run_config(v, 1, 1, 1, 0), PIPE_STEPS, dataset_size=1000)
            for v, _ in runs}
    results = run_distributed(_pipe_worker, world_size=4, runs=runs)
    for rank, res in enumerate(results):
        for (variant, zero), got in res.items():
            _check_run(rank, (variant, zero), got, refs[variant])
