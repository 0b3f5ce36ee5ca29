"""Start-up layout report (rank 0): rank groups, what each pipeline stage holds, its parameters and memory; and
the features of the model as built."""

from __future__ import annotations

from torch import nn

from megatron.config import RunConfig
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.model.attention import SelfAttention
from megatron.model.embedding import Embedding
from megatron.model.gpt_model import OutputLayer
from megatron.model.gpt_model_pipe import partition, spec_parameters, stage_contents
from megatron.model.mlp import MLP
from megatron.model.moe import MoE
from megatron.model.norms import Norm
from megatron.model.transformer import TransformerLayer
from megatron.perf.layout import Layout
from megatron.perf.memory import GIB, estimate_stage_memory, zbh1_caps
from megatron.perf.schedules import bubble_line
from megatron.topology import GCDS_PER_NODE, frontier_placement, group_reports


def sequence_parallel_links(run: RunConfig, ranks_per_node: int = GCDS_PER_NODE) -> str:
    """Which Frontier link DeepSpeed-Ulysses' all-to-alls cross (SP groups) and where its gradients reduce (SP x DP),
    for ``ranks_per_node`` consecutive ranks per node under closest binding."""
    p = run.parallel
    placements = frontier_placement(p.world_size, min(ranks_per_node, p.world_size))
    reports = group_reports(placements, p.tp, p.pp, p.ulysses)
    return (f"  DeepSpeed-Ulysses SP={p.ulysses}: all-to-alls over {reports['ulysses'].summary()}; "
            f"gradients and ZeRO shards over {reports['ulysses_dp'].summary()}")


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.2f} MiB"


def layout_report(run: RunConfig, pstate: ParallelState, partition_method: str = "type:TransformerLayer") -> str:
    """Groups, then one line per stage: contents, parameters per GCD (one TP rank) and estimated peak memory.

    The memory column is megatron/perf/memory.py's model (activations for the 1F1B micro-batches in flight,
    ZeRO-sharded states, the fixed framework overhead); a tied output layer counts its copy of the embedding.
    """
    m, p = run.model, run.parallel
    layout = Layout.from_run(run)
    parts = partition(m, p.pp, partition_method, p.tp, p.ep if m.moe.enabled else 1, p.standalone_embedding_stage)
    per_spec = spec_parameters(m, p.tp, p.ep if m.moe.enabled else 1)
    tied_copy = per_spec[-1] if (m.tie_embeddings and p.pp > 1) else 0
    ulysses = f" x SP {p.ulysses} (DeepSpeed-Ulysses)" if p.ulysses > 1 else ""
    lines = [f"> layout: world {p.world_size} = TP {p.tp} x PP {p.pp}{ulysses} x DP {p.dp}; ZeRO-{p.zero_stage}; "
             f"{run.precision.name}; sequence parallel {p.sequence_parallel}; "
             f"recompute {m.recompute_granularity or 'none'}"
             f"{'' if m.recompute_num_layers is None else f' ({m.recompute_num_layers} layers per stage)'}; "
             f"{layout.num_microbatches} micro-batches per step", pstate.describe()]
    if p.ulysses > 1:
        lines.append(sequence_parallel_links(run))
    if p.pp > 1:
        lines.append("> " + bubble_line(p, m.num_layers, layout.num_microbatches, zbh1_caps(m, layout)))
    engine = "pipeline engine (GPTModelPipe)" if p.pp > 1 else "plain engine (GPTModel)"
    lines.append(f"  stages ({engine}, partition {partition_method if p.pp > 1 else 'n/a'}):")
    for stage, contents in enumerate(stage_contents(m, parts)):
        params = sum(per_spec[parts[stage]:parts[stage + 1]])
        if m.tie_embeddings:
            # The tied output layer has no weight of its own at PP=1, and a copy of the embedding on the last stage.
            params -= per_spec[-1] if stage == p.pp - 1 else 0
            params += tied_copy if stage == p.pp - 1 else 0
        est = estimate_stage_memory(m, layout, stage)
        acts = est.terms["activations"] + est.terms["embedding_activations"] + est.terms["logits"]
        ranks = sorted(g[stage] for g in pstate.all_groups["pp"])
        shown = ",".join(str(r) for r in ranks[:8]) + (",..." if len(ranks) > 8 else "")
        lines.append(f"    stage {stage} (ranks {shown}): {contents} | {params / 1e6:.3f}M params per GCD | "
                     f"est. memory {_size(est.total)} (model states {_size(est.model_states)}, "
                     f"activations {_size(acts)}, buffers and framework {_size(est.total - est.model_states - acts)})")
    return "\n".join(lines)


def _of(model: nn.Module, kind: type) -> list:
    return [m for m in model.modules() if isinstance(m, kind)]


def model_features(model: nn.Module) -> str:
    """One line: what the built module computes (under PP, this rank's stage), read from its submodules rather than
    from the config that built them: norm, MLP activation, positions, attention heads, output layer, linear biases."""
    norms = _of(model, Norm)
    # a standalone embedding stage (--standalone-embedding-stage) holds no norm, layer or linear bias
    parts = ["/".join(sorted({m.kind + ("-1p" if m.one_plus else "") for m in norms}))] if norms else []
    mlps = _of(model, MLP)
    if mlps:
        parts.append("swiglu MLP" if all(m.swiglu for m in mlps) else
                     "squared-relu MLP" if all(m.squared_relu for m in mlps) else "gelu MLP")
    attention = _of(model, SelfAttention)
    if attention:
        a = attention[0]
        if a.cfg.position_embedding_type == "rope":
            parts.append(f"rotary positions ({a.cfg.rotary_dim} of {a.head_dim} dims per head)")
        heads, kv_heads = a.heads * a.tp.size, a.kv_heads * a.tp.size
        parts.append(f"{heads} query heads over {kv_heads} KV heads (GQA)" if kv_heads < heads
                     else f"{heads} heads (MHA)")
    embeddings = _of(model, Embedding)
    if any(e.position_embeddings is not None for e in embeddings):
        parts.append("learned positions")
    if any(e.word_embeddings.fp32_lookup for e in embeddings):
        parts.append("fp32 embedding lookup")
    layers = _of(model, TransformerLayer)
    if any(m.cfg.apply_residual_connection_post_layernorm for m in layers):
        parts.append("post-norm residuals")
    if any(m.cfg.fp32_residual_connection for m in layers + embeddings):
        parts.append("fp32 residual stream")
    outputs = _of(model, OutputLayer)
    if not outputs:
        parts.append("output layer on another stage")
    else:  # a tied output layer has no weight of its own: it projects with the word embeddings
        parts.append("tied output layer" if outputs[0].linear.weight is None else "untied output layer")
    linears = _of(model, ColumnParallelLinear) + _of(model, RowParallelLinear)
    if attention or mlps:
        parts.append("linear biases" if any(m.bias is not None for m in linears) else "no linear biases")
    moe = _of(model, MoE)
    if moe:
        counts = "/".join(str(n) for n in sorted({m.num_experts for m in moe}))
        first = moe[0]
        parts.append(f"{len(moe)} MoE layers ({counts} experts, {first.num_local_experts} on this rank of EP "
                     f"{first.ep_size}, top-{first.deepspeed_moe.moe.topk}{', PR-MoE' if first.use_residual else ''})")
    return "> model features: " + ", ".join(parts)
