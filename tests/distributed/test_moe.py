"""Mixture of experts on EP / EP x TP / ZeRO layouts against one process (4 gloo ranks, one launch).

Each layout trains a 2-layer MoE GPT on DeepSpeed's engine for a few steps: the DP-mean lm loss, the MoE loss and the
gradient norm of every step match the single-process run (tests/reference.py, gradient accumulation over the same
micro-batches) within fp32 tolerance, with top-1 (random token selection on) and top-2 (second-expert sampling on),
with and without token dropping, ZeRO-0/1/2, expert TP and sequence parallelism, PR-MoE. The norms catch a wrongly
scaled expert gradient that Adam would hide from the losses. Then the MoE layer's gradients themselves, parameter by
parameter, for EP=4 and EP x TP=2 (experts whole, and split over TP), before any engine: the all-to-alls' backward.
"""

import pytest
import torch

from megatron.core import comm
from megatron.perf.comm import estimate_comm
from megatron.perf.layout import Layout
from megatron.perf.memory import estimate_memory
from tests.distributed.perf_probe import ObserverCounter
from tests.launch import run_distributed

STEPS, GBS, MBS, SEQ, VOCAB, SEED = 3, 8, 2, 16, 120, 5
TOL = 1e-5

# name -> (TP, EP, ZeRO stage, sequence parallel, MoE settings, other model settings of the layout's run)
LAYOUTS = {
    "ep4 top2 sampling drop": (1, 4, 0, False, dict(topk=2, moe_train_capacity_factor=0.75), {}),
    "ep2xtp2 expert-tp sp top1 no-drop": (2, 2, 0, True, dict(topk=1, moe_token_dropping=False,
                                                              enable_expert_tensor_parallelism=True), {}),
    "ep2xtp2 zero1 top2 drop": (2, 2, 1, False, dict(topk=2, moe_train_capacity_factor=0.75), {}),
    # Full recompute: the gates run again in the backward (the same draws; no-drop's capacity all-reduce again).
    "ep2 zero1 top2 no-drop recompute": (1, 2, 1, False, dict(topk=2, moe_token_dropping=False),
                                         dict(recompute_granularity="full")),
    "ep2 zero2 top1 residual drop": (1, 2, 2, False, dict(topk=1, mlp_type="residual",
                                                          moe_train_capacity_factor=0.75), {}),
}


def _model(moe, **model):
    from megatron.config import MoEConfig
    from megatron.config.sizes import named_model

    return named_model("debug", use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                       seq_length=SEQ, vocab_size=VOCAB, make_vocab_size_divisible_by=64,
                       moe=MoEConfig(num_experts=(4,), expert_interval=1, **moe), **model)


def _run_config(world, tp, ep, zero, seq_par, moe, model=None):
    from megatron.config import OptimizerConfig, ParallelConfig, RunConfig, TrainingConfig

    return RunConfig(
        model=_model(moe, **(model or {})),
        parallel=ParallelConfig(world_size=world, tensor_model_parallel_size=tp, zero_stage=zero,
                                sequence_parallel=seq_par, moe_expert_parallel_size=ep),
        optimizer=OptimizerConfig(lr=4e-3, min_lr=1e-3, lr_warmup_iters=1, clip_grad=0.5, weight_decay=0.1),
        training=TrainingConfig(micro_batch_size=MBS, global_batch_size=GBS, train_iters=STEPS, seed=SEED),
    )


def _train(name):
    import deepspeed.comm as dist

    from megatron.core.parallel_state import ParallelState
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.engine import build_ds_config, initialize_engine
    from megatron.model.gpt_model import GPTModel
    from megatron.training.batches import microbatches
    from megatron.training.step import train_step

    tp, ep, zero, seq_par, moe, model = LAYOUTS[name]
    run = _run_config(dist.get_world_size(), tp, ep, zero, seq_par, moe, model)
    state = ParallelState.build(tp, ep_size=ep)
    model = GPTModel(run.model, tp=state.tp, sequence_parallel=seq_par, init_seed=SEED, ep=state.ep)
    engine = initialize_engine(model, run, state, build_ds_config(run))
    data = microbatches(MockGPTDataset(1000, SEQ, VOCAB, seed=9), 0, MBS, state.dp.rank, state.dp.size, "cpu")
    out = {"lm": [], "moe": [], "norm": []}
    observer = ObserverCounter()  # our collectives (all-to-alls, TP), for the performance model
    observer.active = True
    remove = comm.add_observer(observer)
    for _ in range(STEPS):
        res = train_step(engine, data, run.training.grad_accumulation_steps(state.dp.size))
        both = torch.tensor([res.loss, res.moe_loss])
        dist.all_reduce(both, group=state.dp.group)  # the DP means, as the log reports them
        out["lm"].append(both[0].item() / state.dp.size)
        out["moe"].append(both[1].item() / state.dp.size)
        out["norm"].append(res.grad_norm)
    remove()
    out["comm"] = {"tp": observer.by_op(state.tp.ranks), "ep": observer.by_op(state.ep.ranks)}
    out["params"] = sum(p.numel() for p in engine.module.parameters())
    out["optimizer_bytes"] = _optimizer_state_bytes(engine.optimizer, zero)
    return out


def _optimizer_state_bytes(optimizer, zero):
    """Bytes of the optimizer's states on this rank: Adam's m and v and, under ZeRO-1/2, DeepSpeed's fp32 partitions
    (the inner optimizer's parameters, padding included); the per-tensor ``step`` counters are left out."""
    inner = getattr(optimizer, "optimizer", optimizer) if zero else optimizer
    total = sum(t.numel() * t.element_size() for state in inner.state.values()
                for key, t in state.items() if key in ("exp_avg", "exp_avg_sq"))
    if zero:
        total += sum(p.numel() * p.element_size() for g in inner.param_groups for p in g["params"])
    return total


def _layer_gradients(tp_size, ep_size, seq_par, moe):
    """Every parameter's gradient of the model on this layout (each DP rank one micro-batch, reduced as DeepSpeed
    reduces: dense over DP, experts over their replicas, both divided by DP) against one process on all of them.
    Returns the worst relative difference, the number of parameters compared and the bytes of our collectives over
    the TP and EP groups in the parallel forward and backward."""
    import deepspeed.comm as dist

    from megatron.core import comm
    from megatron.core.parallel_state import GroupInfo, ParallelState
    from megatron.core.tensor_parallel.layers import shard_tensor
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.model.gpt_model import GPTModel
    from megatron.optim.optimizer import is_expert_param
    from megatron.training.batches import microbatches
    from megatron.training.step import gpt_forward_step

    cfg = _model(moe)
    state = ParallelState.build(tp_size, ep_size=ep_size)
    ref = GPTModel(cfg, tp=GroupInfo([0], 0, None), init_seed=SEED)
    par = GPTModel(cfg, tp=state.tp, sequence_parallel=seq_par, init_seed=SEED, ep=state.ep)
    data = microbatches(MockGPTDataset(100, SEQ, VOCAB, seed=3), 0, MBS, 0, 1, "cpu")
    batches = [next(data) for _ in range(state.dp.size)]  # rank d's micro-batch is the d-th
    total = sum(gpt_forward_step(ref, b) + ref.take_moe_loss() for b in batches) / len(batches)
    total.backward()
    observer = ObserverCounter()  # one micro-batch's forward and backward: the collectives of ours
    observer.active = True
    remove = comm.add_observer(observer)
    (gpt_forward_step(par, batches[state.dp.rank]) + par.take_moe_loss()).backward()
    remove()
    sent = {"tp": observer.by_op(state.tp.ranks), "ep": observer.by_op(state.ep.ranks)}
    ref_params = dict(ref.named_parameters())
    local = cfg.moe.num_experts[0] // ep_size
    worst, n = 0.0, 0
    for name, p in par.named_parameters():
        group = state.edp.group if is_expert_param(p) else state.dp.group
        grad = comm.all_reduce(p.grad.clone(), group) / state.dp.size
        if is_expert_param(p):  # local expert i of EP rank r is global expert r * local + i
            head, i, tail = name.partition("deepspeed_experts.")[0], *tail_split(name)
            name = f"{head}deepspeed_experts.{state.ep.rank * local + i}.{tail}"
        want = ref_params[name].grad
        if getattr(p, "tensor_model_parallel", False):
            want = shard_tensor(want, p.partition_dim, state.tp.size, state.tp.rank, getattr(p, "partition_stride", 1))
        worst = max(worst, ((grad - want).abs().max() / max(1.0, want.abs().max().item())).item())
        n += 1
    dist.barrier()
    return worst, n, sent


def tail_split(name):
    """'...deepspeed_experts.3.dense_h_to_4h.weight' -> (3, 'dense_h_to_4h.weight')."""
    i, _, tail = name.partition("deepspeed_experts.")[2].partition(".")
    return int(i), tail


def _worker(names):
    from megatron.initialize import initialize_distributed

    initialize_distributed("gloo")
    out = {name: _train(name) for name in names}
    for key, (tp, ep, seq_par, moe) in GRADIENT_CASES.items():
        out[key] = _layer_gradients(tp, ep, seq_par, moe)
    return out


GRADIENT_CASES = {
    "grad ep4 top2 sampling": (1, 4, False, dict(topk=2, moe_train_capacity_factor=0.75)),
    # Whole experts on 1/TP of the slots each, a capacity of 5 (not divisible by TP: the padded buffer).
    "grad ep2xtp2 top1 rts odd capacity": (2, 2, False, dict(topk=1, moe_train_capacity_factor=0.625)),
    "grad ep2xtp2 expert-tp sp residual": (2, 2, True, dict(topk=1, mlp_type="residual",
                                                            enable_expert_tensor_parallelism=True,
                                                            moe_train_capacity_factor=0.75)),
}


@pytest.mark.timeout(900)
def test_moe_layouts_match_single_process():
    from tests.reference import reference_run

    refs = {name: reference_run(_run_config(1, 1, 1, 0, False, moe), STEPS, dataset_size=1000)
            for name, (_, _, _, _, moe, _) in LAYOUTS.items()}
    results = run_distributed(_worker, world_size=4, names=list(LAYOUTS))
    for rank, res in enumerate(results):
        for name, (lm, norms, moe) in refs.items():
            got = res[name]
            for what, want in (("lm", lm), ("moe", moe), ("norm", norms)):
                for step, (a, b) in enumerate(zip(got[what], want, strict=True)):
                    assert abs(a - b) <= TOL * max(1.0, abs(b)), f"rank {rank} {name} step {step} {what}: {a} vs {b}"
        for key in GRADIENT_CASES:
            worst, n, _ = res[key]
            assert worst <= TOL and n > 20, f"rank {rank} {key}: gradients differ by {worst:.2e} ({n} parameters)"
    _check_plan(results)
    for name, (lm, _, moe) in refs.items():  # the losses move (equality is not trivial); the balancing loss is there
        assert len(set(lm)) == STEPS and len(set(moe)) == STEPS and min(moe) > 0.05, (name, lm, moe)


# Layouts whose capacity is fixed (token dropping): the planner's collectives are exact for them.
COMM_CHECKED = ("ep4 top2 sampling drop", "ep2xtp2 zero1 top2 drop", "ep2 zero2 top1 residual drop")


def _predicted(cfg, layout, steps):
    """{"tp": {op: bytes}, "ep": {op: bytes}} of ``steps`` steps, megatron/perf/comm.py's model of rank 0."""
    want = {"tp": {}, "ep": {}}
    for c in estimate_comm(cfg, layout).collectives:
        if c.group in want:
            want[c.group][c.op] = want[c.group].get(c.op, 0) + c.payload_per_step * steps
    return want


def _check_plan(results):
    """The performance model (megatron/perf) against every rank of every layout: parameter bytes and optimizer-state
    bytes per rank exactly (ZeRO's padded partitions of the dense and expert groups), and, where the capacity is
    fixed, the bytes of every collective of ours over the TP and EP groups, op by op, exactly (also for the gradient
    cases: one micro-batch, the TP-split experts' and sequence parallelism's collectives)."""
    for key, (tp, ep, seq_par, moe) in GRADIENT_CASES.items():
        layout = Layout.of(tp=tp, pp=1, dp=4 // tp, micro_batch_size=MBS, global_batch_size=MBS * 4 // tp, zero_stage=0,
                           sequence_parallel=seq_par, dtype="fp32", moe_expert_parallel_size=ep)
        want = _predicted(_model(moe), layout, 1)
        for rank, res in enumerate(results):
            assert res[key][2] == want, (key, rank, res[key][2], want)
    for name, (tp, ep, zero, seq_par, moe, model) in LAYOUTS.items():
        cfg = _model(moe, **model)
        layout = Layout.of(tp=tp, pp=1, dp=4 // tp, micro_batch_size=MBS, global_batch_size=GBS, zero_stage=zero,
                           sequence_parallel=seq_par, recompute_granularity=model.get("recompute_granularity"),
                           dtype="fp32", moe_expert_parallel_size=ep)
        terms = estimate_memory(cfg, layout, overhead_bytes=0).terms
        want = _predicted(cfg, layout, STEPS)
        for rank, res in enumerate(results):
            got = res[name]
            assert got["params"] * 4 == terms["weights"], (name, rank, got["params"] * 4, terms["weights"])
            assert got["optimizer_bytes"] == terms["optimizer_states"], (name, rank, got["optimizer_bytes"],
                                                                         terms["optimizer_states"])
            if name in COMM_CHECKED:
                assert got["comm"] == want, (name, rank, got["comm"], want)
