"""Pipeline parallelism (DeepSpeed's pipeline engine) against a single-process torch loop over 10 steps.

PP=4 and PP=2 x DP=2 for GPT-2 and Llama variants with tied and untied embeddings (fp32, <= 1e-5), under
ZeRO-0 (our clipping hook) and ZeRO-1 (DeepSpeed's clipping); then TP=2 x PP=2 x DP=2 with ZeRO-1 on
8 processes (<= 1e-4), once with sequence parallelism. Two runs also recompute activations inside the
stages. Clipping is active throughout, so a wrong grad norm would show.

Mixture of experts rides in the same launches: EP=2 x PP=2 on 4 processes and EP=2 x PP=2 x TP=2 on 8 (one with
sequence parallelism and expert TP), top-1 with random token selection and top-2 with second-expert sampling, with
and without token dropping: the lm loss, MoE loss and gradient norm of every step match one process within 1e-5.
"""

import pytest
import torch

from tests.launch import run_distributed

STEPS, GBS, MBS, SEQ, VOCAB = 10, 8, 1, 16, 120
MOE_STEPS, MOE_MBS, MOE_TOL = 4, 2, 1e-5
VARIANTS = {  # name -> (named model, untie)
    "gpt2-tied": ("debug", False),
    "gpt2-untied": ("debug", True),
    "llama-untied": ("debug-llama", True),
    "llama-tied": ("debug-llama", False),
}
# name -> MoE settings of a 4-layer GPT-2 (tied) whose layers 1 and 3 have 4 experts: each of 2 stages holds a dense
# layer then an MoE layer. Random token selection and second-expert sampling are on (the defaults).
MOE_VARIANTS = {
    "moe-top1-drop": dict(topk=1, moe_train_capacity_factor=0.75, moe_min_capacity=2),
    "moe-top2-no-drop": dict(topk=2, moe_token_dropping=False),
    "moe-top1-no-drop": dict(topk=1, moe_token_dropping=False),
    "moe-top2-drop-expert-tp": dict(topk=2, moe_train_capacity_factor=0.75, moe_min_capacity=2,
                                    enable_expert_tensor_parallelism=True),
}


def _run_config(variant, world, tp, pp, zero, recompute=None, seq_par=False, ep=1):
    from megatron.config import MoEConfig, OptimizerConfig, ParallelConfig, RunConfig, TrainingConfig
    from megatron.config.sizes import named_model

    moe = MOE_VARIANTS.get(variant)
    name, untie = VARIANTS[variant] if moe is None else ("debug", False)
    extra = {} if moe is None else {"moe": MoEConfig(**{"num_experts": (4,), "expert_interval": 2, **moe})}
    model = named_model(name, num_layers=4, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                        seq_length=SEQ, vocab_size=VOCAB, make_vocab_size_divisible_by=64,
                        untie_embeddings_and_output_weights=untie, recompute_granularity=recompute, **extra)
    steps, mbs = (STEPS, MBS) if moe is None else (MOE_STEPS, MOE_MBS)
    return RunConfig(
        model=model,
        parallel=ParallelConfig(world_size=world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                zero_stage=zero, sequence_parallel=seq_par, moe_expert_parallel_size=ep),
        optimizer=OptimizerConfig(lr=4e-3, min_lr=1e-3, lr_warmup_iters=2, clip_grad=0.5, weight_decay=0.1),
        training=TrainingConfig(micro_batch_size=mbs, global_batch_size=GBS, train_iters=steps, seed=5),
    )


def reference_losses(variant):
    """One process, no DeepSpeed (tests/reference.py): (lm losses, gradient norms, MoE losses or None)."""
    from tests.reference import reference_run

    run = _run_config(variant, 1, 1, 1, 0)
    return reference_run(run, run.training.train_iters, dataset_size=1000)


def _train_pipe(variant, tp, pp, zero, recompute=None, seq_par=False, ep=1):
    import deepspeed.comm as dist

    from megatron.core.parallel_state import ParallelState
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.engine import build_ds_config, initialize_engine
    from megatron.model.gpt_model_pipe import GPTModelPipe
    from megatron.training.batches import microbatches
    from megatron.training.pipe_step import pipe_microbatches, pipe_train_step

    run = _run_config(variant, dist.get_world_size(), tp, pp, zero, recompute, seq_par, ep)
    moe = run.model.moe.enabled
    state = ParallelState.build(tp, pp, ep_size=ep if moe else None)
    model = GPTModelPipe(run.model, state, sequence_parallel=run.parallel.sequence_parallel,
                         init_seed=run.training.seed)
    engine = initialize_engine(model, run, state, build_ds_config(run))
    mbs = run.training.micro_batch_size
    data = pipe_microbatches(microbatches(MockGPTDataset(1000, SEQ, VOCAB, seed=9), 0, mbs, state.dp.rank,
                                          state.dp.size, "cpu"), sample_index=moe)
    losses, moe_losses, norms = [], [], []
    for _ in range(run.training.train_iters):
        res = pipe_train_step(engine, data)
        t = torch.tensor([res.loss, res.moe_loss or 0.0])
        dist.all_reduce(t, group=state.dp.group)  # the DP-mean losses, as the log reports them
        losses.append(t[0].item() / state.dp.size)
        moe_losses.append(t[1].item() / state.dp.size)
        norms.append(res.grad_norm)
    return {"losses": losses, "norms": norms, "moe": moe_losses if moe else None}


def _worker(runs):
    from megatron.initialize import initialize_distributed

    initialize_distributed("gloo")
    return {run: _train_pipe(*run) for run in runs}


def _close(a, b, tol):
    return abs(a - b) <= tol * max(1.0, abs(b))


def _check(results, refs, tol, moe_tol=MOE_TOL):
    for rank, res in enumerate(results):
        for run, out in res.items():
            ref_losses, ref_norms, ref_moe = refs[run[0]]
            for step, (a, b) in enumerate(zip(out["losses"], ref_losses, strict=True)):
                assert _close(a, b, tol), f"rank {rank} {run} step {step}: {a} vs {b}"
            assert all(n is not None and n > 0 for n in out["norms"]), (run, out["norms"])
            if ref_moe is None:
                continue
            for what, want in (("losses", ref_losses), ("moe", ref_moe), ("norms", ref_norms)):
                for step, (a, b) in enumerate(zip(out[what], want, strict=True)):
                    assert _close(a, b, moe_tol), f"rank {rank} {run} step {step} {what}: {a} vs {b}"
    for name, (ref, _, moe) in refs.items():  # the model must learn, or equal losses would prove little
        if moe is None:
            assert min(ref[5:]) < ref[0] - 0.05, ref
        else:  # the losses move and the balancing loss is there
            assert len(set(ref)) == len(ref) and len(set(moe)) == len(moe) and min(moe) > 0.05, (name, ref, moe)


@pytest.mark.timeout(600)
def test_pp4_and_pp2_dp2_match_single_process():
    # (variant, tp, pp, zero[, recompute]): every variant at PP=4 and at PP=2 x DP=2, ZeRO-0 and ZeRO-1
    # alternating; plus one run with full activation recompute inside the pipeline stages.
    runs = [(v, 1, pp, (i + j) % 2) for i, v in enumerate(VARIANTS) for j, pp in enumerate((4, 2))]
    runs.append(("llama-tied", 1, 2, 1, "full"))
    # MoE, EP=2 x PP=2 (DP=2): ZeRO-1 top-1 with dropping; ZeRO-0 (our clip) top-2 without, stages recomputing.
    runs += [("moe-top1-drop", 1, 2, 1, None, False, 2), ("moe-top2-no-drop", 1, 2, 0, "full", False, 2)]
    refs = {run[0]: reference_losses(run[0]) for run in runs}
    _check(run_distributed(_worker, world_size=4, runs=runs), refs, tol=1e-5)


@pytest.mark.timeout(600)
def test_tp2_pp2_dp2_zero1_matches_single_process():
    # (variant, tp, pp, zero, recompute, sequence parallel[, EP])
    runs = [("gpt2-tied", 2, 2, 1, None, True), ("llama-untied", 2, 2, 1, "selective", False),
            # MoE, EP=2 x PP=2 x TP=2: experts split over TP with sequence parallelism; experts whole on ZeRO-0.
            ("moe-top2-drop-expert-tp", 2, 2, 1, None, True, 2), ("moe-top1-no-drop", 2, 2, 0, None, False, 2)]
    refs = {run[0]: reference_losses(run[0]) for run in runs}
    _check(run_distributed(_worker, world_size=8, runs=runs), refs, tol=1e-4)
