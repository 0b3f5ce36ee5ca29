"""Plan the parallel layout of a GPT on Frontier: predicted memory per GCD and TFLOP/s for every valid layout.

    python tools/plan_parallelism.py --model-size gpt-175b --gcds 1024 --global-batch-size 1536
    python tools/plan_parallelism.py --num-layers 48 --hidden-size 6144 --num-attention-heads 48 --seq-length 2048 \\
        --nodes 2 --global-batch-size 640 --plot plan.png --write-ds-config ds_config.json
    python tools/plan_parallelism.py --model-size gpt-22b --gcds 16 --global-batch-size 640 \\
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 8 --micro-batch-size 1 --zero-stage 1

The model is megatron/perf/ (memory.py, comm.py, step_time.py; calibrated on the ORNL GPT 22B run). The last
line printed is ``best: TP=.. PP=.. DP=.. MBS=.. ZeRO=.. | TFLOPs per GCD: .. | percent of peak: ..``, where
TFLOPs count recomputed FLOPs as Megatron-DeepSpeed's training log does; layouts are ranked by useful (model)
TFLOP/s, i.e. by step time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megatron.config import ModelConfig, MoEConfig
from megatron.errors import ConfigError, run_cli
from megatron.config.sizes import model_names, named_model
from megatron.perf.comm import estimate_comm
from megatron.perf.layout import DTYPE_BYTES, Layout
from megatron.perf.memory import GCD_MEMORY_BYTES, GIB
from megatron.perf.planner import Candidate, SearchSpace, evaluate, plan
from megatron.perf.schedules import schedule_flags
from megatron.topology import GCDS_PER_NODE, TIERS

LAYOUT_FLAGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size", "zero_stage")


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model (a named size, or the shape flags)")
    g.add_argument("--model-size", choices=model_names(), help="a named size from megatron/config/sizes.py")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--num-key-value-heads", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--vocab-size", type=int, help="before padding (default 50257, GPT-2's; named sizes: theirs)")
    g = p.add_argument_group("mixture of experts (upstream's flags)")
    g.add_argument("--num-experts", type=int, nargs="+", default=[1])
    g.add_argument("--expert-interval", type=int, default=2)
    g.add_argument("--topk", type=int, default=1)
    g.add_argument("--mlp-type", choices=("standard", "residual"), default="standard")
    g.add_argument("--moe-train-capacity-factor", type=float, default=1.0)
    g.add_argument("--moe-min-capacity", type=int, default=4)
    g.add_argument("--disable-moe-token-dropping", action="store_true")
    g.add_argument("--enable-expert-tensor-parallelism", action="store_true")
    g.add_argument("--moe-expert-parallel-size", type=int, default=1, help="EP of the explicit layout (default 1)")
    g.add_argument("--ep-sizes", type=int, nargs="+",
                   help="EP sizes the search tries (default: every divisor of the expert count)")
    g = p.add_argument_group("machine and batch")
    g.add_argument("--nodes", type=int, help=f"Frontier nodes ({GCDS_PER_NODE} GCDs each)")
    g.add_argument("--gcds", type=int, help="GCDs (ranks); instead of --nodes")
    g.add_argument("--global-batch-size", type=int, required=True, help="sequences per optimizer step")
    g.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    g.add_argument("--no-flash-attention", action="store_true", help="plan for attention that stores s x s scores")
    g.add_argument("--memory-gib", type=float, default=GCD_MEMORY_BYTES / GIB, help="usable memory per GCD")
    g = p.add_argument_group("one explicit layout (all four, or none to search)")
    g.add_argument("--tensor-model-parallel-size", type=int)
    g.add_argument("--pipeline-model-parallel-size", type=int)
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--zero-stage", type=int)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--recompute-granularity", choices=("full", "selective"))
    g.add_argument("--zero-hpz-partition-size", type=int, help="ZeRO++ hpZ group (ZeRO-3)")
    g.add_argument("--ds-sequence-parallel-size", type=int, default=1,
                   help="DeepSpeed-Ulysses ranks per sequence in the explicit layout (default 1)")
    g.add_argument("--ulysses-sizes", "--sp-sizes", type=int, nargs="+", default=[1],
                   help="DeepSpeed-Ulysses sizes the search tries, e.g. 1 2 4 8 for long sequences (default: 1)")
    g = p.add_argument_group("output")
    g.add_argument("--top", type=int, default=10, help="rows of the table")
    g.add_argument("--plot", metavar="FILE", help="write a PNG: memory vs TFLOP/s, and the step-time terms")
    g.add_argument("--write-ds-config", metavar="FILE", help="write the DeepSpeed JSON for the best layout")
    return p.parse_args(argv)


def model_from_args(args: argparse.Namespace) -> ModelConfig:
    shape = {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
             "num_attention_heads": args.num_attention_heads, "seq_length": args.seq_length}
    optional = {"num_key_value_heads": args.num_key_value_heads, "ffn_hidden_size": args.ffn_hidden_size,
                "vocab_size": args.vocab_size}
    if args.swiglu:
        optional["swiglu"] = True
    optional = {k: v for k, v in optional.items() if v is not None}
    optional["moe"] = MoEConfig(num_experts=tuple(args.num_experts), expert_interval=args.expert_interval,
                                topk=args.topk, mlp_type=args.mlp_type,
                                moe_train_capacity_factor=args.moe_train_capacity_factor,
                                moe_min_capacity=args.moe_min_capacity,
                                moe_token_dropping=not args.disable_moe_token_dropping,
                                enable_expert_tensor_parallelism=args.enable_expert_tensor_parallelism)
    if args.model_size:
        overrides = {k: v for k, v in shape.items() if v is not None} | optional
        if "seq_length" in overrides:
            overrides["max_position_embeddings"] = overrides["seq_length"]
        model = named_model(args.model_size, **overrides)
    else:
        missing = [f"--{k.replace('_', '-')}" for k, v in shape.items() if v is None]
        if missing:
            raise ConfigError(f"no model given: pass --model-size or all of {', '.join(missing)}")
        model = ModelConfig(**shape, **({"vocab_size": 50257} | optional))
    model.validate()
    return model


def gcds_from_args(args: argparse.Namespace) -> int:
    if (args.nodes is None) == (args.gcds is None):
        raise ConfigError("pass exactly one of --nodes and --gcds")
    gcds = args.gcds if args.gcds is not None else args.nodes * GCDS_PER_NODE
    if gcds < 1:
        raise ConfigError(f"--nodes/--gcds must be positive, got {gcds} GCDs")
    return gcds


def explicit_layout(args: argparse.Namespace, gcds: int) -> Layout | None:
    given = [f for f in LAYOUT_FLAGS if getattr(args, f) is not None]
    if not given:
        return None
    if len(given) != len(LAYOUT_FLAGS):
        missing = [f"--{f.replace('_', '-')}" for f in LAYOUT_FLAGS if f not in given]
        raise ConfigError(f"an explicit layout needs all four layout flags; missing {', '.join(missing)}")
    return Layout(world_size=gcds, tensor_model_parallel_size=args.tensor_model_parallel_size,
                  pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                  ds_sequence_parallel_size=args.ds_sequence_parallel_size, micro_batch_size=args.micro_batch_size,
                  global_batch_size=args.global_batch_size, zero_stage=args.zero_stage,
                  sequence_parallel=args.sequence_parallel, recompute_granularity=args.recompute_granularity,
                  flash_attention=not args.no_flash_attention, dtype=args.dtype,
                  zero_hpz_partition_size=args.zero_hpz_partition_size,
                  moe_expert_parallel_size=args.moe_expert_parallel_size if max(args.num_experts) > 1 else 1)


def comm_line(model: ModelConfig, layout: Layout) -> str:
    """Bytes one GCD (stage 0, TP rank 0, DP rank 0) sends per step by link tier, and the experts' all-to-alls'."""
    comm = estimate_comm(model, layout, 0)
    every = comm.wire_bytes_by_tier()
    moe = dict.fromkeys(TIERS, 0.0)
    for c in comm.collectives:
        if c.group == "ep" and c.op == "all_to_all":
            moe[c.tier] += c.wire_bytes
    text = ", ".join(f"{t} {every[t] / 1e9:.3f}" for t in TIERS)
    if model.moe.enabled:
        text += " | MoE all-to-alls: " + ", ".join(f"{t} {moe[t] / 1e9:.3f}" for t in TIERS)
    return f"sent per step by one GCD (GB, by link tier): {text}"


def schedule_line(c: Candidate) -> str:
    """The chosen pipeline schedule, its flags and its predicted bubble (its ranking used it)."""
    lay, t = c.layout, c.time
    schedule = lay.pipeline_schedule
    flags = schedule_flags(schedule, lay.num_layers_per_virtual_pipeline_stage) or "(none: DeepSpeed's default)"
    line = (f"pipeline schedule: {schedule} | flags: {flags} | predicted bubble {t.bubble:.2f} s "
            f"({100 * t.bubble / t.total:.1f}% of the {t.total:.1f} s step)")
    if schedule == "zbh1":
        line += (" | --enable-zbh1-exact-semantics keeps 1F1B's bits at the same predicted cost "
                 "(bench/RESULTS_pipeline_schedules.md)")
    return line


def _gib(x: float) -> str:
    return f"{x / GIB:5.1f}"


def print_table(candidates: list[Candidate]) -> None:
    head = (f"{'#':>3} {'layout':<44} | {'states':>6} {'activ':>6} {'other':>6} {'total':>6} GiB | "
            f"{'compute':>8} {'bubble':>7} {'TP':>6} {'PP':>6} {'DP':>6} {'optim':>6} {'step':>8} s | "
            f"{'TFLOPs':>6} {'%peak':>6} {'MFU%':>5}")
    print(head)
    print("-" * len(head))
    for i, c in enumerate(candidates, 1):
        mem, t = c.memory, c.time
        act = mem.terms["activations"] + mem.terms["embedding_activations"] + mem.terms["logits"]
        other = mem.total - mem.model_states - act
        flag = "" if c.fits else "  DOES NOT FIT"
        print(f"{i:>3} {c.layout.describe():<44} | {_gib(mem.model_states):>6} {_gib(act):>6} {_gib(other):>6} "
              f"{_gib(mem.total):>6}     | {t.compute:8.2f} {t.bubble:7.2f} {t.tp_comm:6.2f} {t.pp_comm:6.2f} "
              f"{t.dp_comm:6.2f} {t.optimizer:6.2f} {t.total:8.2f}   | {t.tflops_per_gcd:6.1f} "
              f"{t.percent_of_peak:6.2f} {t.mfu:5.1f}{flag}")


def ds_config(layout: Layout) -> dict:
    """DeepSpeed JSON for a layout, with every batch number filled (never left to disagree with the flags)."""
    zero: dict = {"stage": layout.zero_stage}
    if layout.zero_stage in (1, 2):
        zero |= {"reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000,
                 "overlap_comm": layout.zero_stage == 2, "contiguous_gradients": True}
    elif layout.zero_stage == 3:
        zero |= {"reduce_bucket_size": 50_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                 "stage3_param_persistence_threshold": 100_000, "overlap_comm": True, "contiguous_gradients": True}
        if layout.zero_hpz_partition_size:
            zero["zero_hpz_partition_size"] = layout.zero_hpz_partition_size
    cfg = {
        "train_batch_size": layout.global_batch_size,
        "train_micro_batch_size_per_gpu": layout.micro_batch_size,
        "gradient_accumulation_steps": layout.num_microbatches,
        "gradient_clipping": 1.0,  # DeepSpeed's default is 1.0 too; stated so --clip-grad and the JSON agree
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }
    if layout.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif layout.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 32, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}
    return cfg


def sbatch_command(model: ModelConfig, layout: Layout, ds_config_path: str | None) -> str:
    gcds = layout.world_size
    nodes = math.ceil(gcds / GCDS_PER_NODE)
    flags = [f"--num-layers {model.num_layers}", f"--hidden-size {model.hidden_size}",
             f"--num-attention-heads {model.num_attention_heads}", f"--seq-length {model.seq_length}",
             f"--max-position-embeddings {model.max_position_embeddings}"]
    if model.num_key_value_heads != model.num_attention_heads:
        flags.append(f"--num-key-value-heads {model.num_key_value_heads}")
    if model.swiglu:
        flags.append("--swiglu")
    flags.append(f"--ffn-hidden-size {model.ffn_hidden_size}")
    flags += [f"--tensor-model-parallel-size {layout.tp}", f"--pipeline-model-parallel-size {layout.pp}",
              f"--micro-batch-size {layout.micro_batch_size}", f"--global-batch-size {layout.global_batch_size}"]
    if layout.sequence_parallel:
        flags.append("--sequence-parallel")
    if layout.ulysses > 1:
        flags.append(f"--ds-sequence-parallel-size {layout.ulysses}")
    if layout.recompute_granularity:
        flags.append(f"--recompute-granularity {layout.recompute_granularity}")
    if layout.flash_attention:
        flags.append("--use-flash-attn-v2")
    if layout.dtype != "fp32":
        flags.append(f"--{layout.dtype}")
    if model.moe.enabled:
        m = model.moe
        flags += [f"--num-experts {' '.join(map(str, m.num_experts))}", f"--expert-interval {m.expert_interval}",
                  f"--topk {m.topk}", f"--moe-expert-parallel-size {layout.ep}"]
        if m.mlp_type != "standard":
            flags.append(f"--mlp-type {m.mlp_type}")
        if m.enable_expert_tensor_parallelism:
            flags.append("--enable-expert-tensor-parallelism")
    schedule = schedule_flags(layout.pipeline_schedule, layout.num_layers_per_virtual_pipeline_stage)
    if schedule:
        flags.append(schedule)
    flags += ["--deepspeed", f"--zero-stage {layout.zero_stage}"]
    if ds_config_path:
        flags.append(f"--deepspeed_config {ds_config_path}")
    srun = (f"srun -N {nodes} -n {gcds} -c7 --gpus-per-task=1 --gpu-bind=closest \"${{PYTHON:-python3}}\" "
            f"pretrain_gpt.py {' '.join(flags)}")
    # The account comes from SBATCH_ACCOUNT in the environment; data/checkpoint flags are the user's to add.
    return (f"sbatch -N {nodes} -t 02:00:00 -S 8 --network=disable_rdzv_get "
            f"--wrap 'source examples/frontier/env.sh && {srun}'")


def write_plot(path: str, everything: list[Candidate], ranked: list[Candidate], capacity: float, top: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    for fits, color, label in ((True, "tab:blue", "fits"), (False, "tab:gray", "over memory")):
        pts = [c for c in everything if c.fits == fits]
        ax1.scatter([c.memory.total / GIB for c in pts], [c.time.model_tflops_per_gcd for c in pts], s=12,
                    c=color, alpha=0.6, label=label)
    if ranked:
        ax1.scatter([ranked[0].memory.total / GIB], [ranked[0].time.model_tflops_per_gcd], s=120, marker="*",
                    c="tab:red", label="best: " + ranked[0].layout.describe())
    ax1.axvline(capacity / GIB, color="k", ls="--", lw=1)
    ax1.set_xscale("log")
    ax1.set(xlabel="predicted memory per GCD (GiB, log)", ylabel="predicted model TFLOP/s per GCD",
            title="every valid layout")
    ax1.legend(fontsize=8)
    rows = ranked[:top]
    names = [c.layout.describe().replace(" (", "\n(") for c in rows]
    left = [0.0] * len(rows)
    for term in ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm", "optimizer"):
        vals = [c.time.terms()[term] for c in rows]
        ax2.barh(names, vals, left=left, label=term)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax2.invert_yaxis()
    ax2.tick_params(axis="y", labelsize=7)
    ax2.set(xlabel="seconds per step", title=f"step-time terms of the top {len(rows)}")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = get_args(argv)
    model = model_from_args(args)
    gcds = gcds_from_args(args)
    capacity = args.memory_gib * GIB
    layout = explicit_layout(args, gcds)
    print(f"model: {model.num_layers} layers, hidden {model.hidden_size}, {model.num_attention_heads} heads, "
          f"seq {model.seq_length}, {model.num_parameters() / 1e9:.2f}B parameters | {gcds} GCDs "
          f"({gcds / GCDS_PER_NODE:g} nodes) | global batch {args.global_batch_size}")
    if layout is not None:
        best = evaluate(model, layout, capacity)
        everything, ranked = [best], [best]
        print_table(ranked)
        if not best.fits:
            print(f"warning: {layout.describe()} needs {best.memory.total / GIB:.1f} GiB per GCD, "
                  f"over {args.memory_gib:g} GiB")
    else:
        space = SearchSpace(flash_attention=not args.no_flash_attention, dtype=args.dtype,
                            ds_sequence_parallel_size=tuple(args.ulysses_sizes),
                            ep=tuple(args.ep_sizes) if args.ep_sizes else None)
        ranked, everything = plan(model, gcds, args.global_batch_size, space, capacity)
        print(f"{len(everything)} valid layouts, {len(ranked)} fit in {args.memory_gib:g} GiB; top {args.top} "
              "by predicted useful TFLOP/s (memory in GiB per GCD, worst stage; time in s per step):")
        print_table(ranked[: args.top])
        best = ranked[0]
    mem = best.memory
    print("memory terms of the best (GiB): " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in mem.terms.items()) +
          f" (stage {mem.stage})")
    print(comm_line(model, best.layout))
    if args.plot:
        write_plot(args.plot, everything, ranked, capacity, args.top)
        print(f"plot: {args.plot}")
    if args.write_ds_config:
        with open(args.write_ds_config, "w") as f:
            json.dump(ds_config(best.layout), f, indent=2)
            f.write("\n")
        print(f"ds_config: {args.write_ds_config}")
    print(schedule_line(best))
    print("sbatch: " + sbatch_command(model, best.layout, args.write_ds_config))
    lay, t = best.layout, best.time
    print(f"best: TP={lay.tp} PP={lay.pp} DP={lay.dp} MBS={lay.micro_batch_size} ZeRO={lay.zero_stage} | "
          f"TFLOPs per GCD: {t.tflops_per_gcd:.1f} | percent of peak: {t.percent_of_peak:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
