"""Dry run of a Frontier launch: where every rank lands (node x GCD, TP/PP/DP coordinates), which link each
parallel group crosses, and the memory one GCD needs. No GPU, no process group.

    python tools/show_layout.py --nodes 128 --model-size gpt-1t --tensor-model-parallel-size 8 \
        --pipeline-model-parallel-size 64 --zero-stage 1 --bf16 --use-flash-attn-v2 --recompute-granularity full

The flags are training's, read by the same path (megatron/arguments/dry_run.py: the parser, the DeepSpeed JSON, the
RunConfig's validation), so a training command line can be passed unchanged; the data files it names are opened and
checked; the other flags the layout does not depend on (--lr, --save, ...) are listed as ignored.
``pretrain_gpt.py --dry-run`` calls :func:`main` with its own argv.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.arguments.dry_run import configure_dry_run
from megatron.config import ModelConfig
from megatron.errors import run_cli
from megatron.perf.layout import Layout
from megatron.perf.memory import GCD_MEMORY_BYTES, GIB, MemoryEstimate, estimate_memory, zbh1_caps
from megatron.perf.schedules import bubble_line
from megatron.topology import (
    GCDS_PER_NODE,
    GroupReport,
    Placement,
    check_tp_within_node,
    coordinates,
    frontier_placement,
    group_reports,
)

MAX_TABLE_NODES = 32
"""Above this many nodes the table shows the first and last nodes only (--all-nodes shows every one)."""
EXIT_DOES_NOT_FIT = 3
"""Exit code of --require-fit when the estimate exceeds one GCD's HBM (the tuning job skips such layouts)."""


def build_parser() -> argparse.ArgumentParser:
    """The dry run's own flags; every other flag is training's (megatron/arguments)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--ranks-per-node", type=int, default=GCDS_PER_NODE, help="ranks of one node under --nodes")
    p.add_argument("--zero-hpz-partition-size", type=int, default=None,
                   help="ZeRO++ hpZ secondary partition (ZeRO-3): a second weight shard over this many ranks")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the layout and the memory terms to a PNG")
    p.add_argument("--summary-only", action="store_true", help="skip the per-rank table")
    p.add_argument("--all-nodes", action="store_true", help=f"table rows for every node, even above {MAX_TABLE_NODES}")
    p.add_argument("--require-fit", action="store_true",
                   help=f"exit {EXIT_DOES_NOT_FIT} if the estimate exceeds one GCD's 64 GiB (for tuning scripts)")
    return p


def _cell(p: Placement, world: int, layout: Layout, experts: bool = False) -> str:
    t, pp_rank, d = coordinates(p.rank, world, layout.tp, layout.pp)
    # With experts: e<EP group>.<EP rank>, the group counted over the DP ranks of one TP rank and stage.
    ep = f"e{d // layout.ep}.{d % layout.ep}" if experts else ""
    return f"{p.rank}:t{t}p{pp_rank}d{d}{ep}"


def _shown_nodes(num_nodes: int, all_nodes: bool) -> list[int | None]:
    """Node indices for the table; None marks an elided run of nodes."""
    if all_nodes or num_nodes <= MAX_TABLE_NODES:
        return list(range(num_nodes))
    half = MAX_TABLE_NODES // 4
    return [*range(half), None, *range(num_nodes - half, num_nodes)]


def format_table(placements: list[Placement], layout: Layout, all_nodes: bool = False, experts: bool = False) -> str:
    """Nodes x GCDs; each cell is ``rank:t<TP rank>p<PP stage>d<DP rank>`` (with experts also ``e<EP group>.<EP
    rank>``), columns in local-rank order."""
    world = len(placements)
    per_node = max(p.local_rank for p in placements) + 1
    by_node: dict[int, list[Placement]] = {}
    for p in placements:
        by_node.setdefault(p.node_index, []).append(p)
    width = max(len(_cell(p, world, layout, experts)) for p in placements) + 1
    width = max(width, 10)
    first = by_node[0]
    head = [("local rank", [f"{p.local_rank}" for p in first]), ("GCD", [f"{p.gcd}" for p in first]),
            ("MI250X", [f"{p.package}" for p in first]), ("NUMA", [f"{p.numa}" for p in first]),
            ("cores", [f"{p.cores[0]}-{p.cores[-1]}" for p in first]),
            ("SMT", [f"{p.smt_siblings[0]}-{p.smt_siblings[-1]}" for p in first])]
    lines = [f"{label:<11}|" + "".join(f"{v:>{width}}" for v in vals) for label, vals in head]
    lines.append("-" * (12 + width * per_node))
    for node in _shown_nodes(len(by_node), all_nodes):
        if node is None:
            lines.append(f"{'...':<11}|  (nodes elided; --all-nodes shows them)")
            continue
        cells = "".join(f"{_cell(p, world, layout, experts):>{width}}" for p in by_node[node])
        lines.append(f"{'node ' + str(node):<11}|" + cells)
    return "\n".join(lines)


def format_groups(reports: dict[str, GroupReport]) -> str:
    lines = []
    for report in reports.values():
        g = report.groups[0]
        example = g if len(g) <= 8 else [*g[:4], "...", *g[-2:]]
        lines.append(f"  {report.summary()}; e.g. [{', '.join(map(str, example))}]")
    ep = reports.get("ep")
    if ep is not None and "network" in ep.tiers:
        lines.append(f"  WARNING: {ep.tiers.count('network')} of {len(ep.groups)} EP groups cross nodes: every MoE "
                     f"layer's token all-to-alls go over Slingshot; use --moe-expert-parallel-size x "
                     f"--tensor-model-parallel-size <= {GCDS_PER_NODE}")
    return "\n".join(lines)


def format_memory(est: MemoryEstimate, layout: Layout) -> str:
    lines = [f"Memory per GCD (worst GCD: pipeline stage {est.stage} of {layout.pp}; megatron/perf/memory.py):"]
    for term, value in est.terms.items():
        if value:
            lines.append(f"  {term:<24}{value / GIB:9.2f} GiB")
    verdict = "fits" if est.fits() else "DOES NOT FIT"
    lines.append(f"  {'total':<24}{est.total / GIB:9.2f} GiB of {GCD_MEMORY_BYTES / GIB:.0f} GiB HBM per GCD: "
                 f"{verdict} ({100 * est.total / GCD_MEMORY_BYTES:.0f}%)")
    if not est.fits():
        hints = []
        if layout.recompute_granularity != "full":
            hints.append("--recompute-granularity full")
        if layout.tp > 1 and not layout.sequence_parallel:
            hints.append("--sequence-parallel")
        if layout.ulysses == 1 and layout.dp > 1:
            hints.append("--ds-sequence-parallel-size (long sequences: activations / SP)")
        hints.append("a larger --pipeline-model-parallel-size or --tensor-model-parallel-size (<= 8)")
        lines.append(f"  try: {'; '.join(hints)}")
    return "\n".join(lines)


def render(model: ModelConfig, layout: Layout, ranks_per_node: int = GCDS_PER_NODE,
           allow_tp_across_nodes: bool = False, summary_only: bool = False,
           all_nodes: bool = False) -> tuple[str, MemoryEstimate, list[Placement], dict[str, GroupReport]]:
    """The whole dry-run report as text, plus the pieces the plot needs (``layout``: a validated run's)."""
    world = layout.world_size
    layout.validate_for(model)
    check_tp_within_node(world, layout.tp, layout.pp, ranks_per_node, allow_tp_across_nodes)
    placements = frontier_placement(world, ranks_per_node)
    experts = model.moe.enabled
    reports = group_reports(placements, layout.tp, layout.pp, layout.ulysses, layout.ep if experts else None)
    est = estimate_memory(model, layout)
    nodes = placements[-1].node_index + 1
    out = [
        (f"Layout: {world} ranks on {nodes} node(s) x {ranks_per_node} GCDs: {layout.describe()}, "
         f"global batch {layout.global_batch_size} ({layout.num_microbatches} micro-batches per step), {layout.dtype}"
         f"{', flash attention' if layout.flash_attention else ''}"),
        (f"Model: {model.num_layers} layers, hidden {model.hidden_size}, {model.num_attention_heads} heads, "
         f"seq {model.seq_length}, vocab {model.vocab_size}: {model.num_parameters(layout.tp) / 1e9:.2f}B parameters; "
         f"layers per stage {_stage_text(layout.stage_layers(model.num_layers))}{_experts_text(model, layout)}"),
    ]
    if layout.pp > 1:
        out.append("P" + bubble_line(layout, model.num_layers, layout.num_microbatches, zbh1_caps(model, layout))[1:])
    if not summary_only:
        cell = "rank:t<TP rank>p<PP stage>d<DP rank>" + ("e<EP group>.<EP rank>" if experts else "")
        out += ["", f"Ranks (cell = {cell}; srun -c7 --gpu-bind=closest, #SBATCH -S 8):",
                format_table(placements, layout, all_nodes, experts)]
    out += ["", ("Groups, by the slowest link they cross: package (200 GB/s) > node (50-100 GB/s) > "
             "network (100 GB/s per node, shared by its 8 GCDs):"),
            format_groups(reports), "", format_memory(est, layout)]
    return "\n".join(out), est, placements, reports


def _experts_text(model: ModelConfig, layout: Layout) -> str:
    moe = [n for n in model.layer_experts() if n > 1]
    if not moe:
        return ""
    counts = "/".join(str(n) for n in sorted(set(moe)))
    return (f"; {len(moe)} MoE layers of {counts} experts (top-{model.moe.topk}, EP={layout.ep}), "
            f"{model.num_parameters(layout.tp, active=True) / 1e9:.2f}B parameters active per token")


def _stage_text(layers: list[int]) -> str:
    return str(layers[0]) if len(set(layers)) == 1 else f"{max(layers)} (first) .. {min(layers)} (last)"


def plot(path: str, placements: list[Placement], layout: Layout, est: MemoryEstimate,
         reports: dict[str, GroupReport]) -> None:
    """PNG: the node x GCD grid coloured by pipeline stage, and the memory terms as a stacked bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    world = len(placements)
    per_node = max(p.local_rank for p in placements) + 1
    nodes = placements[-1].node_index + 1
    stage = np.full((nodes, per_node), np.nan)
    for p in placements:
        stage[p.node_index, p.local_rank] = coordinates(p.rank, world, layout.tp, layout.pp)[1]
    fig, (ax, bar) = plt.subplots(1, 2, figsize=(13, max(4.5, min(12.0, 1.5 + 0.45 * nodes))),
                                  gridspec_kw={"width_ratios": [3, 1]})
    im = ax.imshow(stage, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="pipeline stage", ticks=MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xticks(range(per_node), [f"lr{i}\nGCD{placements[i].gcd}" for i in range(per_node)])
    ax.set_ylabel("node")
    if nodes <= 32:
        for p in placements:
            t, s, d = coordinates(p.rank, world, layout.tp, layout.pp)
            ax.text(p.local_rank, p.node_index, f"{p.rank}\nt{t} p{s} d{d}", ha="center", va="center",
                    fontsize=7, color="white" if s < layout.pp / 2 else "black")
    tiers = "; ".join(f"{r.kind.upper()}={r.size}: {r.worst_tier}" for r in reports.values())
    ax.set_title(f"{world} ranks, {layout.describe()}\n{tiers}", fontsize=9)
    bottom = 0.0
    for term, value in est.terms.items():
        if value:
            bar.bar(0, value / GIB, bottom=bottom, label=f"{term} {value / GIB:.1f}")
            bottom += value / GIB
    bar.axhline(GCD_MEMORY_BYTES / GIB, color="red", linestyle="--", label="64 GiB HBM")
    bar.set_xticks([])
    bar.set_ylabel("GiB per GCD")
    bar.set_title(f"stage {est.stage}: {est.total / GIB:.1f} GiB", fontsize=9)
    bar.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    own, training_flags = build_parser().parse_known_args(argv)
    dry = configure_dry_run(training_flags, own.ranks_per_node)
    run = dry.run
    layout = Layout.from_run(run, zero_hpz_partition_size=own.zero_hpz_partition_size)
    text, est, placements, reports = render(run.model, layout, own.ranks_per_node, run.runtime.allow_tp_across_nodes,
                                            own.summary_only, own.all_nodes)
    if dry.data:
        text += f"\n\n{dry.data}"
    if dry.ignored:
        text += f"\n\n(ignored training flags: {' '.join(dry.ignored)})"
    print(text, flush=True)
    if own.plot:
        plot(own.plot, placements, layout, est, reports)
        print(f"wrote {own.plot}", flush=True)
    if own.require_fit and not est.fits():
        print(f"does not fit: {est.total / GIB:.1f} GiB > {GCD_MEMORY_BYTES / GIB:.0f} GiB per GCD", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
