"""Bytes per Frontier tier for ZeRO-3, DeepSpeed ZeRO++ hpZ and hierarchical ZeRO (fp32 and int8), measured.

Trains the debug GPT (fp32, ~110k parameters) on 8 local gloo processes that simulate 2 nodes x 2 packages x 2 GCDs
(4 ranks per "node"), counts every collective (tests/distributed/perf_probe.py's counters) and puts each on a
tier with megatron/topology.py's placement. Then the planner's predicted step time for a 20B GPT on 48 nodes.

    nice -n 10 .venv/bin/python bench/comm_tiers.py [--steps 4] [--out bench/RESULTS_hzero.md]

Last lines: ``network_bytes_per_gcd_per_step <mode> <bytes>`` (group convention, see accounting.py).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.hierarchical_zero.accounting import bytes_by_op, tier_bytes  # noqa: E402
from megatron.topology import TIERS, frontier_placement  # noqa: E402

MODES = ("zero3", "hpz", "ours", "ours-int8")
WORLD, RANKS_PER_NODE = 8, 4
NODES_20B, GBS_20B = 48, 1536


def measure(steps: int, release_layers: bool) -> dict[str, list[dict]]:
    from tests.distributed.hzero_probe import worker
    from tests.launch import run_distributed

    jobs = [{"mode": m, "steps": steps, "release_layers": release_layers} for m in MODES]
    per_rank = run_distributed(worker, world_size=WORLD, timeout=1200, jobs=jobs, ranks_per_node=RANKS_PER_NODE)
    return {m: [r[i] for r in per_rank] for i, m in enumerate(MODES)}


def per_gcd(results: list[dict], mode: str) -> dict[str, float]:
    placements = frontier_placement(WORLD, RANKS_PER_NODE)
    out = dict.fromkeys(TIERS, 0.0)
    for rank, r in enumerate(results):
        for tier, b in tier_bytes(r["counts"], placements, rank, r["counted_steps"], mode).items():
            out[tier] += b / WORLD
    return out


def predicted() -> dict[str, tuple[float, float, float]]:
    """(step seconds, exposed DP comm seconds, network bytes per GCD) for GPT 20B on 48 nodes, TP=1 PP=1."""
    from megatron.config.sizes import named_model
    from megatron.perf.comm import estimate_comm
    from megatron.perf.layout import Layout
    from megatron.perf.step_time import estimate_step_time

    tiers = "package,node,network"  # --zero-hierarchy's form
    kw = {"zero3": {}, "hpz": {"zero_hpz_partition_size": 8}, "ours": {"zero_hierarchy": tiers},
          "ours-int8": {"zero_hierarchy": tiers, "zero_hierarchy_int8": True}}
    model, out = named_model("gpt-20b"), {}
    for mode in MODES:
        layout = Layout.of(tp=1, pp=1, dp=NODES_20B * 8, micro_batch_size=1, global_batch_size=GBS_20B, zero_stage=3,
                           recompute_granularity="full", **kw[mode])
        st = estimate_step_time(model, layout)
        out[mode] = (st.total, st.dp_comm, estimate_comm(model, layout).wire_bytes_by_tier()["network"])
    return out


def report(measured: dict[str, list[dict]], release_layers: bool) -> list[str]:
    how = ("ZeRO-3/hpZ release each layer after forward" if release_layers else "DeepSpeed's default reuse")
    lines = ["## Measured: bytes one GCD sends per optimizer step (debug GPT, fp32, 8 ranks = 2 nodes x 2 packages "
             f"x 2 GCDs; {how})", "",
             "| mode | package | node | network (group) | network (ring) | network vs ZeRO-3 | loss after last step |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    base = per_gcd(measured["zero3"], "group")["network"]
    for mode in MODES:
        g, ring = per_gcd(measured[mode], "group"), per_gcd(measured[mode], "ring")
        lines.append(f"| {mode} | {g['package']:,.0f} | {g['node']:,.0f} | {g['network']:,.0f} | "
                     f"{ring['network']:,.0f} | {g['network'] / base:.3f} | {measured[mode][0]['losses'][-1]:.6f} |")
    lines += ["", "Payload per step on rank 0, by (tier, op, group size):", "",
              "| mode | tier | op | group | payload bytes |", "|---|---|---|---:|---:|"]
    placements = frontier_placement(WORLD, RANKS_PER_NODE)
    for mode in MODES:
        r = measured[mode][0]
        for (tier, op, n), b in sorted(bytes_by_op(r["counts"], placements, r["counted_steps"]).items()):
            lines.append(f"| {mode} | {tier} | {op} | {n} | {b:,.0f} |")
    lines += ["", f"## Predicted: GPT 20B on {NODES_20B} nodes ({NODES_20B * 8} GCDs), TP=1 PP=1 DP={NODES_20B * 8}, "
              f"micro-batch 1, global batch {GBS_20B}, bf16, full recompute (megatron/perf)", "",
              "| mode | step time (s) | exposed DP comm (s) | network bytes per GCD per step (GB) |",
              "|---|---:|---:|---:|"]
    for mode, (t, dp, net) in predicted().items():
        lines.append(f"| {mode} | {t:.2f} | {dp:.2f} | {net / 1e9:.1f} |")
    lines.append("")
    for mode in MODES:
        lines.append(f"network_bytes_per_gcd_per_step {mode} {per_gcd(measured[mode], 'group')['network']:.0f}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per mode (the first is not counted)")
    p.add_argument("--keep-layers", action="store_true",
                   help="DeepSpeed's defaults for ZeRO-3/hpZ, under which this tiny model stays gathered from forward "
                        "to backward (default: release every layer and re-gather it in backward, as at 20B)")
    p.add_argument("--out", default=None, help="also write the tables to this markdown file")
    args = p.parse_args()
    lines = report(measure(args.steps, not args.keep_layers), not args.keep_layers)
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Hierarchical ZeRO: bytes per tier (bench/comm_tiers.py)\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
