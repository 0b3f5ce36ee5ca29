"""The mixture-of-experts collectives of one step on one GCD (megatron/model/moe*.py, megatron/core/moe/), for
megatron/perf/comm.py; per MoE layer and micro-batch, payloads as comm.py counts them.

* EP: the token all-to-all twice in forward (to the experts, back) and twice in backward, of this rank's buffer
  ``E x C/TP x h`` (C: the slots per expert, padded to a multiple of TP); with --disable-moe-token-dropping one 8-byte
  all-reduce (MAX) of the busiest expert's count. Full recompute replays the forward's.
* TP > 1: each TP rank sends 1/TP of the slots, so the slots are all-gathered back after the second all-to-all
  (forward) and the first all-to-all's input gradient is all-gathered (backward), ``E x C x h`` each. Whole experts
  (no --enable-expert-tensor-parallelism) have their gradients summed over TP, one all-reduce per parameter tensor;
  TP-split experts run their MLP in sequence-parallel mode over the slots (per local expert: fc1's input all-gather
  and fc2's output reduce-scatter in forward, the mirror in backward, of ``C x EP x h``; fc2's bias gradient
  all-reduced), and PR-MoE's TP-split MLP all-reduces ``s x b x h`` in forward and backward.
* Expert data parallelism: the experts' gradients (and, with ZeRO-1/2, the updated weights) over their replicas, as
  the dense ones over DP (comm.py), ``expert_dp`` ranks strided by EP.

The capacity with token dropping is DeepSpeed's ``ceil(tokens / E x factor x k)`` (at least --moe-min-capacity); without
dropping it depends on the routing, and the same formula is an estimate (exact when the busiest expert has that many).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from megatron.config import ModelConfig
from megatron.perf.layout import Layout

Add = Callable[..., None]


def moe_capacity(model: ModelConfig, tokens: int, num_experts: int, training: bool = True) -> int:
    """Slots per expert for ``tokens`` routed tokens (megatron/core/moe/gating.py's ``capacity``, float32 as
    DeepSpeed's): top-2 and top-k scale the factor by k."""
    m = model.moe
    factor = (m.moe_train_capacity_factor if training else m.moe_eval_capacity_factor) * m.topk
    cap = math.ceil(np.float32(tokens / num_experts) * np.float32(factor))
    return max(cap, m.moe_min_capacity)


def padded_slots(capacity: int, tp: int) -> int:
    """The dispatch buffer's slots per expert: the capacity rounded up to a multiple of TP (each TP rank sends 1/TP)."""
    return -(-capacity // tp) * tp


def moe_layer_collectives(add: Add, model: ModelConfig, layout: Layout, num_experts: int, n_layers: int,
                          tp_ranks: list[int], ep_ranks: list[int]) -> None:
    """The collectives of ``n_layers`` MoE layers of ``num_experts`` experts (per micro-batch x m micro-batches)."""
    s, b, h, t, a = model.seq_length, layout.micro_batch_size, model.hidden_size, layout.tp, layout.dtype_bytes
    m, moe = layout.num_microbatches, model.moe
    calls = m * n_layers
    replay = 1 if layout.recompute_granularity == "full" else 0
    slots = padded_slots(moe_capacity(model, s * b, num_experts), t)  # C: the gate sees the whole micro-batch
    buffer = num_experts * slots * h * a  # [E, C, h]
    add("ep", "all_to_all", "moe tokens", calls * (4 + 2 * replay), buffer / t, ep_ranks)
    if not moe.moe_token_dropping:
        add("ep", "all_reduce", "moe capacity", calls * (1 + replay), 8, ep_ranks)
    if t == 1:
        return
    add("tp", "all_gather", "moe slots", calls * (2 + replay), buffer, tp_ranks)
    local = num_experts // layout.ep
    bias = 1 if model.add_bias_linear else 0
    if not moe.enable_expert_tensor_parallelism:
        tensors = local * (2 + 2 * bias)
        _, _, em, ev = model.layer_parameter_kinds(t, num_experts, layout.ep)
        add("tp", "all_reduce", "expert grads", calls * tensors, (em + ev) * a / tensors, tp_ranks)
        return
    gathered = slots * layout.ep * h * a  # one expert's slots from every EP rank, gathered over TP: [C, ep, h]
    add("tp", "all_gather", "expert mlp", calls * local * (2 + replay), gathered, tp_ranks)
    add("tp", "reduce_scatter", "expert mlp", calls * local * (2 + replay), gathered, tp_ranks)
    add("tp", "all_reduce", "expert bias grads", calls * local * bias, h * a, tp_ranks)
    if moe.mlp_type == "residual":
        add("tp", "all_reduce", "residual mlp", calls * (2 + replay), s * b * h * a, tp_ranks)
