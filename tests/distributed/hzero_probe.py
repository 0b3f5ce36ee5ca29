"""Workers that train a tiny GPT under ZeRO-3, ZeRO++ hpZ and hierarchical ZeRO and count bytes per tier.

Used by tests/distributed/test_hierarchical_zero.py and bench/comm_tiers.py (through tests.launch). Byte
counting reuses tests/distributed/perf_probe.py's counters; tiers come from megatron/topology.py's placement with
a simulated node size (``ranks_per_node``), so 8 local processes stand for 2 nodes x 2 packages x 2 GCDs.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile

import torch

MODES = ("zero3", "hpz", "ours", "ours-int8")
MODEL_KW = {"seq_length": 16, "vocab_size": 120}


def run_config(world: int, tp: int, mode: str, gbs: int, steps: int, model_kw: dict | None = None,
               weights: str = "node", levels: str = "package,node,network", bf16: bool = False,
               user_config: str | None = None):
    """The RunConfig of one mode (fp32 unless ``bf16``, clipping active, dropout off), with ``user_config`` as its
    --deepspeed_config."""
    from megatron.arguments.deepspeed_json import with_deepspeed_json
    from megatron.config import OptimizerConfig, ParallelConfig, PrecisionConfig, RunConfig, TrainingConfig
    from megatron.config.sizes import named_model

    kw = {"use_cpu_initialization": True, "hidden_dropout": 0.0, "attention_dropout": 0.0,
              "make_vocab_size_divisible_by": 64} | MODEL_KW | (model_kw or {})
    ours = mode.startswith("ours")
    return RunConfig(**with_deepspeed_json(dict(
        model=named_model("debug", **kw),
        parallel=ParallelConfig(world_size=world, tensor_model_parallel_size=tp, zero_stage=3,
                                zero_hierarchy=levels if ours else None, zero_hierarchy_weights=weights,
                                zero_hierarchy_int8=mode == "ours-int8"),
        # A weight decay ramped 0.1 -> 1.0 (--weight-decay-incr-style): the engine applies the decay itself,
        # and one stuck at 0.1 moves the losses ~9x the tolerance (test_zero.py checks that margin).
        optimizer=OptimizerConfig(lr=4e-3, min_lr=1e-3, lr_warmup_iters=2, clip_grad=0.5,
                                  weight_decay_incr_style="linear", start_weight_decay=0.1, end_weight_decay=1.0),
        training=TrainingConfig(micro_batch_size=1, global_batch_size=gbs, train_iters=steps, seed=5),
        precision=PrecisionConfig(bf16=bf16),
    ), user_config))


def reference_losses(gbs: int, steps: int, model_kw: dict | None = None) -> list[float]:
    """One process, no DeepSpeed (tests/reference.py), on the same data."""
    from tests.reference import reference_losses as plain

    return plain(run_config(1, 1, "zero3", gbs, steps, model_kw), steps)


def _train_mode(mode: str, tp: int, gbs: int, steps: int, ranks_per_node: int, counter, model_kw: dict | None,
                weights: str, levels: str, bf16: bool = False, stop_after: int | None = None,
                release_layers: bool = False) -> dict:
    """Train ``steps`` steps (or stop after ``stop_after`` of a ``steps``-long LR schedule).

    ``release_layers``: ZeRO-3/hpZ free every layer after its forward and re-gather it for backward (reuse distance,
    live parameters and prefetch bucket 1), as DeepSpeed does with a model of billions of parameters; by default a
    model this small stays gathered from forward to backward."""
    import deepspeed.comm as dist

    from megatron.core import comm
    from megatron.core.parallel_state import ParallelState
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.engine import build_ds_config, initialize_engine, template_path
    from megatron.model.gpt_model import GPTModel
    from megatron.training.batches import microbatches
    from megatron.training.step import train_step
    from tests.distributed.perf_probe import ObserverCounter

    user_config = None
    if mode == "hpz":  # DeepSpeed's own hpZ through a user JSON, sized by megatron/engine.py from our topology
        with open(template_path(3, "fp32")) as f:
            cfg = json.load(f)
        cfg["megatron_frontier"] = {"zero_hpz": "node", "ranks_per_node": ranks_per_node}
        user_config = os.path.join(tempfile.mkdtemp(), "hpz.json")
        with open(user_config, "w") as f:
            json.dump(cfg, f)
    run = run_config(dist.get_world_size(), tp, mode, gbs, steps, model_kw, weights, levels, bf16, user_config)
    state = ParallelState.build(tp)
    model = GPTModel(run.model, tp=state.tp, init_seed=run.training.seed)
    ds = build_ds_config(run)
    assert mode != "hpz" or ds["zero_optimization"]["zero_hpz_partition_size"] == ranks_per_node // tp
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # really partition tiny params
    if release_layers and not mode.startswith("ours"):
        ds["zero_optimization"].update(stage3_max_reuse_distance=1, stage3_max_live_parameters=1,
                                       stage3_prefetch_bucket_size=1)
    if mode.startswith("ours"):
        ds["megatron_frontier"]["ranks_per_node"] = ranks_per_node
    engine = initialize_engine(model, run, state, ds)
    m = run.model
    data = microbatches(MockGPTDataset(4000, m.seq_length, m.vocab_size, seed=9), 0, 1, state.dp.rank,
                        state.dp.size, "cpu")
    observer = ObserverCounter()
    remove = comm.add_observer(observer)
    counter.bytes.clear(), counter.calls.clear()
    losses = []
    for step in range(stop_after or steps):
        # Step 0 is warm-up (ZeRO-3 traces its fetch order): count the rest.
        counter.active = observer.active = step > 0
        res = train_step(engine, data, run.training.grad_accumulation_steps(state.dp.size))
        counter.active = observer.active = False
        t = torch.tensor([res.loss])
        dist.all_reduce(t, group=state.dp.group)  # the DP-mean loss, as the log reports it
        losses.append(t.item() / state.dp.size)
    remove()
    counts = dict(observer.bytes if mode.startswith("ours") else counter.bytes)
    del engine
    gc.collect()
    return {"losses": losses, "counts": counts, "counted_steps": len(losses) - 1}


def worker(jobs: list[dict], ranks_per_node: int) -> list[dict]:
    """Run each job (keywords of ``_train_mode`` minus the counter) in turn on this rank."""
    from megatron.initialize import initialize_distributed
    from tests.distributed.perf_probe import TorchDistCounter

    counter = TorchDistCounter()
    counter.install()  # before the process group exists: DeepSpeed captures some entry points at creation
    initialize_distributed("gloo")
    base = {"tp": 1, "gbs": 8, "steps": 10, "model_kw": None, "weights": "node", "levels": "package,node,network"}
    return [_train_mode(counter=counter, ranks_per_node=ranks_per_node, **(base | job)) for job in jobs]
