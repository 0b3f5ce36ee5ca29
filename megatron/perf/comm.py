"""Communication of one training step on one GCD, per parallel group and per Frontier link tier.

Counting conventions (what a wrapper around ``torch.distributed`` sees, and what goes over the wire):

* ``payload_bytes`` of a call is the *unsharded* tensor of the collective: the tensor of an all-reduce or a
  send, the gathered output of an all-gather, the full input of a reduce-scatter.
* ``wire_bytes`` is what this rank sends under ring algorithms: all-reduce ``2(n-1)/n x payload``,
  all-gather and reduce-scatter ``(n-1)/n x payload``, a point-to-point send ``payload``. Receives are not
  counted (they mirror the sends).

Which collectives run follows Megatron-LM with the DeepSpeed engine:

* TP follows this repository's layers (megatron/core/tensor_parallel), per layer and micro-batch. Without
  sequence parallelism (SP): 2 all-reduces in forward (outputs of the row-parallel attention projection
  and FC2) and 2 in backward (input gradients of the column-parallel QKV and FC1, from copy-to-TP). With
  SP: the column-parallel layers all-gather their input in forward and keep the gathered input for the
  weight gradient (no re-gather in backward), then reduce-scatter the input gradient; the row-parallel
  layers reduce-scatter their output in forward and all-gather its gradient in backward: 4 all-gathers +
  4 reduce-scatters of ``s x b x h`` per layer. Under SP every replicated parameter used on sequence
  shards (the two norms' weight and bias, the row-parallel biases) all-reduces its ``h``-element gradient
  over TP inside autograd, every micro-batch. Full recompute replays the forward's collectives except FC2's
  output all-reduce / reduce-scatter (torch's checkpoint stops early once every saved tensor is rebuilt).
  The embedding all-reduces its output in forward (SP: then splits the sequence, so its backward
  all-gathers the gradient); the output layer all-reduces its input gradient in backward (SP: all-gather
  forward, reduce-scatter backward; final-norm gradients all-reduced); the vocab-parallel cross entropy
  does one fp32 all-reduce (MAX) of ``b x s`` and one fp32 all-reduce of ``2 x b x s``.
  Scalar bookkeeping (grad norm, loss averaging) is not modelled.
* PP: per micro-batch one activation send forward (all but the last stage) and one gradient send backward
  (all but the first), ``s x b x h`` (/t with SP, /u with Ulysses), from every TP rank. With tied embeddings
  and PP > 1 the first and last stages all-reduce the word-embedding gradient once per step.
* SP (DeepSpeed-Ulysses, megatron/core/ulysses.py), per layer and micro-batch: one all-to-all of this rank's
  fused QKV ``s/u x b x (nq + 2 nkv)/t x d`` and one of its attention context ``s/u x b x nq/t x d`` in forward,
  the same two in backward, and both again under full recompute (Q, K, V and the context are saved tensors, so
  the replay reaches them). Payload is the rank's own tensor (what ``comm.all_to_all`` sends and its byte
  observer counts); ``(u-1)/u`` of it leaves the rank. The loss's two-number all-reduce is bookkeeping.
* DP over the local parameter shard P, as DeepSpeed 0.19.8 does it (counted in gloo runs,
  tests/distributed/test_perf_model_measured.py); with Ulysses over SP x DP, where DeepSpeed reduces and shards.
  ZeRO-0 all-reduces gradients once per step. ZeRO-1 and ZeRO-2 *all-reduce* the gradient buckets and keep
  their slice (``use_multi_rank_bucket_allreduce``, on by default), not a reduce-scatter: ZeRO-1 once per
  step, ZeRO-2 every micro-batch; both all-gather the
  updated weights once per step. ZeRO-3 all-gathers weights in forward and reduce-scatters gradients every
  micro-batch; in backward it re-gathers only the parameters it released, i.e. those whose next use lies
  more than ``stage3_max_reuse_distance`` parameters ahead (``zero3_kept_parameters``; over the hpZ group
  with ZeRO++ hpZ). A stage under 0.5e9 parameters per GCD is gathered once per micro-batch.

* EP (mixture of experts): megatron/perf/moe_comm.py; an MoE layer has no dense MLP, so its TP collectives are the
  attention's (plus its own); the experts' gradients reduce over their replicas, not over DP.

Rank order is Megatron's (TP innermost, then DP, then PP) with 8 GCDs per node and 2 per MI250X package
(``megatron.topology``); a group's tier is the slowest link it crosses.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache

from megatron.config import ModelConfig
from megatron.perf.hzero import hierarchical_zero_collectives
from megatron.perf.layout import Layout
from megatron.perf.memory import (
    ZERO3_MAX_REUSE_DISTANCE,
    residual_bytes,
    stage_parameter_kinds,
    zero3_kept_parameters,
)
from megatron.perf.moe_comm import moe_layer_collectives
from megatron.topology import GCDS_PER_NODE, TIERS

GB = 1e9
PACKAGE_BW = 200 * GB
"""GCD <-> GCD inside one MI250X package."""
NODE_BW = 50 * GB
"""GCD <-> GCD across packages: the low end of FRONTIER.md's 50-100 GB/s, since rings use the slowest hop."""
NIC_BW_PER_NODE = 100 * GB
"""4 Slingshot NICs x 25 GB/s, shared by every GCD of the node that talks off-node at the same time."""
LATENCY = {"package": 5e-6, "node": 10e-6, "network": 30e-6}
"""Per ring step (per send); rough RCCL figures, an assumption rather than a measurement."""


@dataclass
class Collective:
    group: str
    """'tp', 'pp', 'dp' (experts' replicas included), 'ulysses' (DeepSpeed-Ulysses' all-to-alls), 'ep' (experts) or
    'embedding' (first <-> last stage)."""
    op: str
    """'all_reduce', 'all_gather', 'reduce_scatter', 'all_to_all' or 'send'."""
    phase: str
    """What it is for, e.g. 'layer fwd', 'zero grads'."""
    calls: int
    """Calls per optimizer step on this rank."""
    payload_bytes: float
    """Bytes of the unsharded tensor of one call (see the module docstring)."""
    group_size: int
    tier: str
    members_on_node: int
    """Members of the group on this rank's node (1 for a send): how many share the node's NICs."""
    concurrent_on_node: int = 1
    """GCDs of the node that push the same kind of traffic off-node at the same time."""

    @property
    def wire_factor(self) -> float:
        n = self.group_size
        if self.op == "send":
            return 1.0
        return (2.0 if self.op == "all_reduce" else 1.0) * (n - 1) / n

    @property
    def payload_per_step(self) -> float:
        return self.calls * self.payload_bytes

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends per step."""
        return self.calls * self.payload_bytes * self.wire_factor

    def bandwidth(self) -> float:
        """Bytes/s one rank can push in this collective: the slowest link of the ring."""
        if self.tier == "package":
            return PACKAGE_BW
        if self.tier == "node":
            return NODE_BW
        if self.op == "send":
            # Off-node sends: the node's 100 GB/s is split among the GCDs sending at once.
            return NIC_BW_PER_NODE / max(1, self.concurrent_on_node)
        # A ring with k members per node crosses the node boundary once, so the 8/k groups on the node share
        # its NICs; the ring also runs at the speed of its intra-node hops.
        k = self.members_on_node
        share = NIC_BW_PER_NODE * k / GCDS_PER_NODE
        return share if k == 1 else min(share, PACKAGE_BW if k == 2 else NODE_BW)

    def seconds_per_call(self) -> float:
        if self.op == "all_to_all" and self.tier == "network":
            # Unlike a ring, an all-to-all sends (n-k)/n of its payload off the node (k members on it), from every
            # GCD of the node at once: they share its NICs, 12.5 GB/s each; the rest goes over the node's links.
            n, k = self.group_size, self.members_on_node
            off, on = self.payload_bytes * (n - k) / n, self.payload_bytes * (k - 1) / n
            return LATENCY["network"] * (n - 1) + max(off / (NIC_BW_PER_NODE / GCDS_PER_NODE), on / NODE_BW)
        # An all-to-all is (n-1) pairwise exchanges of payload/n each: the same steps and bytes as a ring gather.
        steps = 1 if self.op == "send" else (self.group_size - 1) * (2 if self.op == "all_reduce" else 1)
        return LATENCY[self.tier] * steps + self.payload_bytes * self.wire_factor / self.bandwidth()

    @property
    def seconds(self) -> float:
        return self.calls * self.seconds_per_call()


@dataclass
class CommEstimate:
    stage: int
    collectives: list[Collective]

    def wire_bytes_by_tier(self) -> dict[str, float]:
        out = dict.fromkeys(TIERS, 0.0)
        for c in self.collectives:
            out[c.tier] += c.wire_bytes
        return out

    def payload_by_group(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for c in self.collectives:
            out[c.group] += c.payload_per_step
        return dict(out)

    def seconds(self, groups: tuple[str, ...] | None = None, phases: tuple[str, ...] | None = None) -> float:
        return sum(c.seconds for c in self.collectives
                   if (groups is None or c.group in groups) and (phases is None or c.phase in phases))


def _tier(ranks: list[int]) -> str:
    if len({r // GCDS_PER_NODE for r in ranks}) > 1:
        return "network"
    return "package" if len({r // 2 for r in ranks}) == 1 else "node"


@lru_cache(maxsize=4096)
def _group_geometry(ranks: tuple[int, ...], me: int) -> tuple[str, int]:
    """(tier, members on my node) of a group; cached because the planner asks for the same groups often."""
    my_node = me // GCDS_PER_NODE
    return _tier(list(ranks)), sum(1 for r in ranks if r // GCDS_PER_NODE == my_node)


def _rank(layout: Layout, stage: int, dp_rank: int = 0, tp_rank: int = 0, ulysses_rank: int = 0) -> int:
    """Megatron's order with Ulysses inside DP: rank = ((stage * DP + dp) * SP + u) * TP + tp."""
    return ((stage * layout.dp + dp_rank) * layout.ulysses + ulysses_rank) * layout.tp + tp_rank


def _shard_rank(layout: Layout, stage: int, d: int) -> int:
    """The ``d``-th rank (TP rank 0) of the SP x DP group of ``stage``, where ZeRO shards and gradients reduce."""
    return _rank(layout, stage, d // layout.ulysses, 0, d % layout.ulysses)


def ulysses_all_to_all_bytes(model: ModelConfig, layout: Layout) -> tuple[float, float]:
    """(QKV, context) bytes this rank sends into each of a layer's two Ulysses all-to-alls, per micro-batch."""
    u, t = layout.ulysses, layout.tp
    tokens = model.seq_length // u * layout.micro_batch_size
    d, a = model.head_dim, layout.dtype_bytes
    qkv = tokens * (model.num_attention_heads + 2 * model.num_key_value_heads) // t * d * a
    return float(qkv), float(tokens * model.num_attention_heads // t * d * a)


def _norm_tensors(model: ModelConfig) -> int:
    """Parameters of one norm, each ``h`` elements (LayerNorm: weight and bias; RMSNorm: weight)."""
    return 2 if model.normalization == "layernorm" else 1


def _seq_par_replicated_params(model: ModelConfig, moe: bool = False) -> int:
    """Gradient all-reduces per layer under SP, each of ``h`` elements: norm weights/biases, row-parallel biases (an
    MoE layer has no dense MLP: the projection's only)."""
    return 2 * _norm_tensors(model) + ((1 if moe else 2) if model.add_bias_linear else 0)


def _stage_experts(model: ModelConfig, layout: Layout, stage: int) -> list[int]:
    """Expert count of each layer of ``stage`` (1: dense)."""
    counts = layout.stage_layers(model.num_layers)
    first = sum(counts[:stage])
    return model.layer_experts()[first:first + counts[stage]]


def estimate_comm(model: ModelConfig, layout: Layout, stage: int = 0,
                  zero3_reuse_distance: float = ZERO3_MAX_REUSE_DISTANCE) -> CommEstimate:
    """Collectives of one step on TP rank 0, DP rank 0 of pipeline ``stage``."""
    s, b, h, t = model.seq_length, layout.micro_batch_size, model.hidden_size, layout.tp
    a = layout.dtype_bytes
    m = layout.num_microbatches
    act = s * b * h * a
    me = _rank(layout, stage)
    out: list[Collective] = []

    def add(group: str, op: str, phase: str, calls: int, payload: float, ranks: list[int], conc: int = 1) -> None:
        if calls <= 0 or payload <= 0 or len(ranks) < 2:
            return
        tier, on_node = _group_geometry(tuple(ranks), me)
        if op == "send":
            on_node = 1
        out.append(Collective(group, op, phase, calls, float(payload), len(ranks), tier, on_node, conc))

    experts = _stage_experts(model, layout, stage)
    tp_ranks = [_rank(layout, stage, 0, i) for i in range(t)]
    if t > 1:
        n_moe = sum(1 for n in experts if n > 1)
        n_dense = len(experts) - n_moe
        # Full recompute replays the layer's forward, but torch's non-reentrant checkpoint stops once the last
        # saved tensor is rebuilt: FC2's output collective (nothing saves its result) is not replayed.
        replay = 1 if layout.recompute_granularity == "full" else 0
        seq_par = layout.sequence_parallel
        # An MoE layer has the attention's collectives only (its gate and dispatch run on replicated tokens); under
        # SP it gathers the sequence in forward (replayed) and its split's gradient in backward: as many gathers.
        if seq_par:
            add("tp", "all_gather", "layers", m * len(experts) * (4 + 2 * replay), act, tp_ranks)
            add("tp", "reduce_scatter", "layers", m * (n_dense * (4 + replay) + n_moe * (2 + replay)), act, tp_ranks)
            add("tp", "all_reduce", "seq-par param grads", m * (n_dense * _seq_par_replicated_params(model)
                                                         + n_moe * _seq_par_replicated_params(model, moe=True)), h * a,
                tp_ranks)
        else:
            add("tp", "all_reduce", "layers", m * (n_dense * (4 + replay) + n_moe * (2 + replay)), act, tp_ranks)
        if stage == 0:  # the lookup's partial sums, fp32 with --embedding-weights-in-fp32
            lookup = s * b * h * 4 if model.embedding_weights_in_fp32 else act
            add("tp", "all_reduce", "embedding", m, lookup, tp_ranks)
            if seq_par:
                add("tp", "all_gather", "embedding", m, act, tp_ranks)
        if stage == layout.pp - 1:
            if seq_par:
                add("tp", "all_gather", "output layer", m, act, tp_ranks)
                add("tp", "reduce_scatter", "output layer", m, act, tp_ranks)
                add("tp", "all_reduce", "final norm grads", m * _norm_tensors(model), h * a, tp_ranks)
            else:
                add("tp", "all_reduce", "output layer", m, act, tp_ranks)
            add("tp", "all_reduce", "cross entropy max", m, 4 * s * b, tp_ranks)
            add("tp", "all_reduce", "cross entropy sum", m, 8 * s * b, tp_ranks)

    if layout.ulysses > 1:
        ulysses_ranks = [_rank(layout, stage, 0, 0, j) for j in range(layout.ulysses)]
        n_layers = layout.stage_layers(model.num_layers)[stage]
        passes = 2 + (1 if layout.recompute_granularity == "full" else 0)  # forward, backward, replayed forward
        for payload in ulysses_all_to_all_bytes(model, layout):
            add("ulysses", "all_to_all", "attention", m * n_layers * passes, payload, ulysses_ranks)

    for n in sorted(set(experts) - {1}):
        moe_layer_collectives(add, model, layout, n, experts.count(n), tp_ranks,
                              [_shard_rank(layout, stage, d) for d in range(layout.ep)])

    stage_gcds = min(GCDS_PER_NODE, t * layout.shard_dp)
    if layout.pp > 1:
        # the residual stream crosses stages (fp32 with --fp32-residual-connection)
        p2p = s * b * h * residual_bytes(model, layout) / (t if layout.sequence_parallel else 1) / layout.ulysses
        if stage < layout.pp - 1:
            add("pp", "send", "activations", m, p2p, [me, _rank(layout, stage + 1)], stage_gcds)
        if stage > 0:
            add("pp", "send", "gradients", m, p2p, [me, _rank(layout, stage - 1)], stage_gcds)
        if model.tie_embeddings and stage in (0, layout.pp - 1):
            pair = [_rank(layout, 0), _rank(layout, layout.pp - 1)]
            add("embedding", "all_reduce", "tied embedding grads", 1,
                model.padded_vocab_size(t) * h // t * a, pair, stage_gcds)

    if layout.shard_dp > 1:
        dm, dv, em, ev = stage_parameter_kinds(model, layout, stage)
        p = dm + dv
        w, g = p * a, p * a  # 16-bit (or fp32) weights and gradients on the wire
        dp_ranks = [_shard_rank(layout, stage, d) for d in range(layout.shard_dp)]
        # The experts' gradients and weights go over their replicas instead (EP-strided DP ranks).
        edp_ranks = [_shard_rank(layout, stage, d) for d in range(0, layout.shard_dp, layout.ep)]
        z = layout.zero_stage
        if z == 0:
            add("dp", "all_reduce", "grads", 1, g, dp_ranks)
            add("dp", "all_reduce", "expert grads", 1, (em + ev) * a, edp_ranks)
        elif z in (1, 2):
            add("dp", "all_reduce", "grads", 1 if z == 1 else m, g, dp_ranks)
            add("dp", "all_gather", "weights", 1, w, dp_ranks)
            add("dp", "all_reduce", "expert grads", 1 if z == 1 else m, (em + ev) * a, edp_ranks)
            add("dp", "all_gather", "expert weights", 1, (em + ev) * a, edp_ranks)
        elif layout.zero_hierarchy:
            hierarchical_zero_collectives(add, model, p, a, m, layout.dp, t, lambda d: _rank(layout, stage, d),
                                          layout.zero_hierarchy_int8)
        else:
            add("dp", "all_gather", "weights fwd", m, w, dp_ranks)
            k = layout.zero_hpz_partition_size or layout.shard_dp
            released = p - zero3_kept_parameters(p, zero3_reuse_distance)
            add("dp", "all_gather", "weights bwd", m, released * a, dp_ranks[:k])
            add("dp", "reduce_scatter", "grads", m, g, dp_ranks)
    return CommEstimate(stage=stage, collectives=out)
