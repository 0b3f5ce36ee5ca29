"""Peak memory of one GCD for a model and layout: weights, gradients, optimizer states, activations.

Conventions (all numbers are bytes on one GCD):

* Model states follow the ZeRO paper (Rajbhandari et al. 2020) for mixed-precision Adam: 2 bytes of 16-bit
  weights, 2 bytes of 16-bit gradients and 12 bytes of optimizer state (fp32 master copy + Adam m + v) per
  parameter; for fp32 training 4 + 4 + 8, plus a 4-byte fp32 copy of the local partition with ZeRO >= 1
  (DeepSpeed's ZeRO optimizers keep one even when the weights are fp32). ZeRO-1 shards the optimizer states
  over DP, ZeRO-2 also the gradients, ZeRO-3 also the weights. ZeRO-3 also holds gathered full weights:
  DeepSpeed keeps a gathered parameter until backward when its reuse lies within ``stage3_max_reuse_distance``
  (1e9) parameters, so the last 0.5e9 parameters of the stage stay gathered, plus the layer computing and the
  one prefetched (``zero3_kept_parameters``); hpZ adds a second weight shard over its group.
* Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", Section 4, generalised to GQA / SwiGLU / any FFN width. Per layer and micro-batch, with
  16-bit activations and 1-byte dropout masks, for GPT-2 shapes (kv = h, ffn = 4h) this reduces to their
  formulas: ``sbh(10 + 24/t + 5as/(ht))`` with TP t and no sequence parallelism; ``sbh/t (34 + 5as/h)``
  with SP; the ``5as^2b`` score term becomes ``4asb`` bytes (fp32 log-sum-exp) with flash attention and 0
  with selective recompute; full recompute stores only each layer's input (``2sbh``, /t with SP) plus one
  layer's full working set during its backward.
* Upstream's variants: with --fp32-residual-connection the residual stream (the norms' inputs, full recompute's
  checkpoints, the tensors between stages) counts 4 bytes; --embedding-weights-in-fp32 adds the lookup's transient
  fp32 copy of the table on stage 0; --standalone-embedding-stage leaves stage 0 without layers.
* Pipeline: with 1F1B, stage i holds min(pp - i, num_microbatches) micro-batches in flight, so the first
  stage (which also holds the embedding) is the worst for activations; the last stage holds the logits
  (the 16-bit output plus the fp32 softmax kept by the vocab-parallel cross entropy) and, with tied
  embeddings and PP > 1, a copy of the word embeddings. The estimate is the worse of the two.
* DeepSpeed's ZeRO optimizers allocate a gradient bucket of ``reduce_bucket_size`` elements (5e7 in
  deepspeed_configs/), in fp32 for ZeRO-1 (its fp32 accumulator) and in the training dtype for ZeRO-2/3:
  200 MB in the fp32 CPU tests, where it was measured; the bf16 sizes are read from DeepSpeed's source.
* The optimizer step: with ZeRO >= 1 the flat fp32 partition gets an fp32 gradient and AdamW temporaries
  (``OPTIMIZER_STEP_BYTES`` per local parameter). The activations are gone by then, so this is a second
  peak; the ``optimizer_step`` term is only its excess over the backward-phase peak.
* A fixed framework overhead (ROCm context, RCCL buffers, allocator slack) is a separate term, ``overhead_bytes``;
  pass 0 to get the model's own bytes only (what the CPU measurements are compared with).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config import ModelConfig
from megatron.core.pipeline.deferral_cap import ZB_SCHEDULES, deferral_caps
from megatron.perf.layout import Layout
from megatron.perf.schedules import held

GIB = 2**30
GCD_MEMORY_BYTES = 64 * GIB
"""HBM of one MI250X GCD."""
FRAMEWORK_OVERHEAD_BYTES = 3 * GIB
"""ROCm context + RCCL/DeepSpeed buffers + caching-allocator slack; an assumption, not a measurement."""

ZERO3_MAX_REUSE_DISTANCE = 1e9
"""DeepSpeed's default ``stage3_max_reuse_distance`` (parameters)."""
REDUCE_BUCKET_SIZE = 5e7
"""``reduce_bucket_size`` of the ds_config templates in deepspeed_configs/ (elements)."""

OPTIMIZER_STEP_BYTES = 12
"""Per parameter of the local ZeRO partition during the step: DeepSpeed's fp32 gradient partition (4) and
torch AdamW's two temporaries on the flat fp32 partition (8; measured on CPU, single-tensor AdamW)."""

TERMS = ("weights", "gradients", "optimizer_states", "zero3_gathered", "zero_bucket", "activations",
         "embedding_activations", "logits", "optimizer_step", "framework_overhead")


@dataclass
class MemoryEstimate:
    terms: dict[str, float]
    """Bytes per term; the keys are always ``TERMS``."""
    stage: int
    """Pipeline stage this estimate is for (the worst one when returned by ``estimate_memory``)."""

    @property
    def total(self) -> float:
        return float(sum(self.terms.values()))

    @property
    def model_states(self) -> float:
        return self.terms["weights"] + self.terms["gradients"] + self.terms["optimizer_states"]

    def fits(self, capacity: float = GCD_MEMORY_BYTES) -> bool:
        return self.total <= capacity


def stage_parameter_kinds(model: ModelConfig, layout: Layout, stage: int) -> tuple[int, int, int, int]:
    """Parameters on one GCD of pipeline ``stage`` before any ZeRO sharding, as the optimizer groups them:
    (dense matrices, dense vectors, expert matrices, expert vectors); experts split over ``layout.ep``."""
    counts = layout.stage_layers(model.num_layers)
    first = sum(counts[:stage])
    kinds = [0, 0, 0, 0]
    for n in model.layer_experts()[first:first + counts[stage]]:
        kinds = [a + b for a, b in zip(kinds, model.layer_parameter_kinds(layout.tp, n, layout.ep), strict=True)]
    words = model.word_embedding_parameters(layout.tp)
    if stage == 0:
        kinds[0] += words + model.position_parameters()  # positions are replicated over TP, as in Megatron
    if stage == layout.pp - 1:
        kinds[1] += model.norm_parameters()
        if model.untie_embeddings_and_output_weights or layout.pp > 1:
            # Untied output layer, or Megatron's copy of the tied word embeddings on the last stage.
            kinds[0] += words
    return kinds[0], kinds[1], kinds[2], kinds[3]


def stage_parameters(model: ModelConfig, layout: Layout, stage: int) -> int:
    """Parameters on one GCD of pipeline ``stage`` before any ZeRO sharding (experts: this EP rank's)."""
    return sum(stage_parameter_kinds(model, layout, stage))


def zero_partition(numel: int, ranks: int) -> int:
    """Elements of one rank's ZeRO-1/2 partition of an optimizer group of ``numel`` elements: DeepSpeed pads the
    flat group to a multiple of 2 x ranks (``nccl_start_alignment_factor``) and splits it evenly."""
    return -(-numel // (2 * ranks)) * 2 if numel else 0


def local_partition(model: ModelConfig, layout: Layout, stage: int) -> int:
    """Elements of the optimizer's partition on one GCD under ZeRO-1/2: each of the four optimizer groups
    (``stage_parameter_kinds``) padded and split, the dense ones over SP x DP, the experts' over their replicas."""
    dm, dv, em, ev = stage_parameter_kinds(model, layout, stage)
    return (zero_partition(dm, layout.shard_dp) + zero_partition(dv, layout.shard_dp)
            + zero_partition(em, layout.expert_dp) + zero_partition(ev, layout.expert_dp))


def activation_bytes_per_layer(model: ModelConfig, layout: Layout) -> float:
    """Bytes one layer keeps for its backward, for one micro-batch, without recomputation."""
    s, b, h, t = model.seq_length, layout.micro_batch_size, model.hidden_size, layout.tp
    kv = model.num_key_value_heads * model.head_dim
    f, nh = model.ffn_hidden_size, model.num_attention_heads
    a = layout.dtype_bytes
    mask = 1 if model.hidden_dropout > 0 else 0
    # Outside the TP region: two norm inputs, the QKV and FC1 inputs, two dropout masks (10 sbh for GPT-2); the norm
    # inputs are the residual stream, fp32 with --fp32-residual-connection. Sequence parallelism shards them over TP.
    outside = s * b * h * (2 * residual_bytes(model, layout) + 2 * a + 2 * mask)
    if layout.sequence_parallel:
        outside /= t
    # Inside the TP region, sharded over t: Q, K, V, the projection input, the MLP hidden (24 sbh for GPT-2).
    fc1_saved = 2 * f if model.swiglu else f
    inside = s * b * a * (h + 2 * kv + h + fc1_saved + f) / t
    if layout.recompute_granularity == "selective":
        scores = 0.0
    elif layout.flash_attention:
        scores = 4.0 * nh * s * b / t  # fp32 log-sum-exp per query row
    else:
        # softmax output + its dropout output (a bytes each) and the dropout mask (1 byte): 5as^2b for 16-bit.
        drop = model.attention_dropout > 0
        scores = nh * s * s * b * (a + (a + 1 if drop else 0)) / t
    # DeepSpeed-Ulysses: every saved tensor holds 1/SP of the sequence, or (inside attention: Q, K, V, the
    # scores) the whole sequence for 1/SP of the heads; both are 1/SP of the bytes.
    return (outside + inside + scores) / layout.ulysses


def residual_bytes(model: ModelConfig, layout: Layout) -> int:
    """Bytes per element of the residual stream: the layers' inputs, the checkpoints of full recompute and the tensors
    sent between pipeline stages (4 with --fp32-residual-connection)."""
    return 4 if model.fp32_residual_connection else layout.dtype_bytes


def deferred_weight_input_bytes_per_layer(model: ModelConfig, layout: Layout) -> float:
    """Bytes one layer's B pass leaves for its W under zero-bubble H1, for one micro-batch: each deferred linear's
    input and output gradient (QKV, projection, FC1, FC2; the inputs outside the TP region whole, gathered under
    sequence parallelism). MoE layers count their MLP as ``topk x capacity factor`` of one."""
    s, b, h, t = model.seq_length, layout.micro_batch_size, model.hidden_size, layout.tp
    kv = model.num_key_value_heads * model.head_dim
    f = model.ffn_hidden_size
    attention = h + (h + 2 * kv) / t + h / t + h  # x_qkv, g_qkv, x_proj, g_proj
    mlp = h + (2 * f if model.swiglu else f) / t + f / t + h  # x_fc1, g_fc1, x_fc2, g_fc2
    if model.moe.enabled:
        mlp *= model.moe.topk * model.moe.moe_train_capacity_factor
    return s * b * layout.dtype_bytes * (attention + mlp) / layout.ulysses


def zero3_kept_parameters(stage_params: float, reuse_distance: float = ZERO3_MAX_REUSE_DISTANCE) -> float:
    """Gathered parameters ZeRO-3 keeps from forward to backward: a layer's next use comes after every later
    layer's forward and backward (about twice the parameters after it), so the last ``reuse_distance / 2``
    parameters of the stage are kept."""
    return min(stage_params, reuse_distance / 2)


def _in_flight(layout: Layout, stage: int) -> int:
    return min(layout.pp - stage, layout.num_microbatches)


def estimate_stage_memory(model: ModelConfig, layout: Layout, stage: int,
                          overhead_bytes: float = FRAMEWORK_OVERHEAD_BYTES,
                          reduce_bucket_size: float = REDUCE_BUCKET_SIZE) -> MemoryEstimate:
    """Memory of one GCD in pipeline ``stage`` (0-based). ``overhead_bytes=0`` leaves out the assumed
    framework overhead."""
    t, a = layout.tp, layout.dtype_bytes
    mixed = layout.dtype in ("bf16", "fp16")
    kinds = stage_parameter_kinds(model, layout, stage)
    params = sum(kinds)
    dp, z = layout.shard_dp, layout.zero_stage  # ZeRO shards over SP x DP, experts over their replicas
    # ZeRO-1/2: this rank's padded partition of each optimizer group (exact, tests/distributed/test_moe.py);
    # ZeRO-3 (no experts): the plain share.
    local = local_partition(model, layout, stage) if z in (1, 2) else params / dp
    terms = dict.fromkeys(TERMS, 0.0)
    terms["weights"] = params * a / (dp if z >= 3 else 1)
    terms["gradients"] = (local if z >= 2 else params) * a
    # fp32: Adam m + v, and DeepSpeed's fp32 partition copy once ZeRO partitions the optimizer.
    state_bytes = 12 if (mixed or z >= 1) else 8
    terms["optimizer_states"] = (local if z >= 1 else params) * state_bytes
    if z == 3:
        kept = zero3_kept_parameters(params, ZERO3_MAX_REUSE_DISTANCE)
        terms["zero3_gathered"] = min(params, kept + 2 * model.layer_parameters(t)) * a
        if layout.zero_hpz_partition_size:
            terms["zero3_gathered"] += params * a / layout.zero_hpz_partition_size

    if z >= 1:
        terms["zero_bucket"] = reduce_bucket_size * (4 if z == 1 else a)

    in_flight = _in_flight(layout, stage)
    n_layers = layout.stage_layers(model.num_layers)[stage]
    kept, extra = _layer_activations(model, layout, n_layers)
    schedule = layout.pipeline_schedule
    if schedule == "1f1b":
        terms["activations"] = kept * in_flight + extra
    else:  # what the schedule's compute order holds at its worst instant (megatron/perf/schedules.py held)
        v = layout.virtual_stages(model.num_layers)
        deferred = n_layers * deferred_weight_input_bytes_per_layer(model, layout)
        caps = zbh1_caps(model, layout)
        terms["activations"] = held(schedule, layout.pp, layout.num_microbatches, stage, kept, deferred, v,
                                    cap=caps[stage] if caps else None).peak_bytes + extra
    terms["embedding_activations"] = _embedding_mask(model, layout, stage) * in_flight
    if stage == 0 and model.embedding_weights_in_fp32 and a < 4:
        # The lookup's fp32 copy of this rank's table (its gradient in the backward is as large): transient.
        terms["embedding_activations"] += 4 * model.word_embedding_parameters(t)
    terms["logits"] = _head(model, layout, stage)
    if z >= 1:
        # The optimizer step runs after the activations are freed, so its transient only counts above them.
        in_backward = sum(terms[k] for k in ("activations", "embedding_activations", "logits", "zero3_gathered"))
        terms["optimizer_step"] = max(0.0, OPTIMIZER_STEP_BYTES * local - in_backward)
    terms["framework_overhead"] = float(overhead_bytes)
    return MemoryEstimate(terms=terms, stage=stage)


def _layer_activations(model: ModelConfig, layout: Layout, n_layers: int) -> tuple[float, float]:
    """(what ``n_layers`` layers keep per micro-batch, the one layer's working set full recompute adds)."""
    per_layer = activation_bytes_per_layer(model, layout)
    if layout.recompute_granularity != "full":
        return n_layers * per_layer, 0.0
    s, b, h, t = model.seq_length, layout.micro_batch_size, model.hidden_size, layout.tp
    checkpoint = s * b * h * residual_bytes(model, layout) / (t if layout.sequence_parallel else 1) / layout.ulysses
    return n_layers * checkpoint, per_layer


def _seq_div(layout: Layout) -> int:
    return (layout.tp if layout.sequence_parallel else 1) * layout.ulysses


def _embedding_mask(model: ModelConfig, layout: Layout, stage: int) -> float:
    """Stage 0's embedding dropout mask of one micro-batch."""
    if stage != 0 or model.hidden_dropout <= 0:
        return 0.0
    return model.seq_length * layout.micro_batch_size * model.hidden_size / _seq_div(layout)


def _head(model: ModelConfig, layout: Layout, stage: int) -> float:
    """The last stage's head of one micro-batch: final-norm input and output-layer input, then the logits (16-bit
    output + the fp32 softmax kept for the backward)."""
    if stage != layout.pp - 1:
        return 0.0
    s, b, h, t, a = model.seq_length, layout.micro_batch_size, model.hidden_size, layout.tp, layout.dtype_bytes
    v = model.padded_vocab_size(t)
    norms = (residual_bytes(model, layout) + a) * s * b * h / _seq_div(layout)
    return norms + s * b * (v / t) * (a + 4) / layout.ulysses


def stage_micro_batch_bytes(model: ModelConfig, layout: Layout) -> tuple[list[float], list[float]]:
    """Per stage, one micro-batch's activations (its layers', stage 0's embedding mask, the last stage's head) and its
    weight-gradient inputs under zero-bubble H1: what the memory cap weighs (the engine counts them in its first step,
    megatron/core/pipeline/engine.py)."""
    acts, deferred = [], []
    w_inputs = deferred_weight_input_bytes_per_layer(model, layout)
    for stage, n in enumerate(layout.stage_layers(model.num_layers)):
        kept, _ = _layer_activations(model, layout, n)
        acts.append(kept + _embedding_mask(model, layout, stage) + _head(model, layout, stage))
        deferred.append(n * w_inputs)
    return acts, deferred


def zbh1_caps(model: ModelConfig, layout: Layout) -> tuple[int, ...] | None:
    """Zero-bubble H1's memory cap per stage as this model predicts it (None under another schedule)."""
    if layout.pipeline_schedule not in ZB_SCHEDULES or layout.pp == 1:
        return None
    return deferral_caps(layout.pipeline_schedule, layout.pp, layout.num_microbatches,
                         *stage_micro_batch_bytes(model, layout))


def estimate_memory(model: ModelConfig, layout: Layout, overhead_bytes: float = FRAMEWORK_OVERHEAD_BYTES,
                    reduce_bucket_size: float = REDUCE_BUCKET_SIZE) -> MemoryEstimate:
    """Peak memory of the worst GCD.

    Only the first and last stages can be the worst: every middle stage has no more layers (the remainder
    goes to the first stages), fewer micro-batches in flight and no embedding than the first. With a standalone
    embedding stage the first stage of layers (stage 1) is a candidate too.
    """
    first = estimate_stage_memory(model, layout, 0, overhead_bytes, reduce_bucket_size)
    if layout.pp == 1:
        return first
    stages = {layout.pp - 1} | ({1} if layout.standalone_embedding_stage else set())
    others = [estimate_stage_memory(model, layout, st, overhead_bytes, reduce_bucket_size) for st in sorted(stages)]
    return max([first, *others], key=lambda e: e.total)
