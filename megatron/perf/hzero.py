"""Communication of hierarchical ZeRO-3 (megatron/core/hierarchical_zero) for the performance model.

Per GCD, with P parameters on its stage, ``a`` bytes per element, m micro-batches, DP ranks per package
``kp`` (2 at TP=1, else 1), per node ``k`` (8 / TP, at most DP) and ``k / kp`` per node-level group:

* every micro-batch: the weights all-gather from the node-wide secondary partition, over the node level (output
  P / kp) then the package level (output P), layer by layer; the same again in backward for every layer but the
  first bucket (the embedding, kept from forward to backward); the gradient reduce-scatter over the package level
  (input P) then the node level (input P / kp), accumulated in fp32;
* once per step, over the network group (one rank per node): the gradient reduce-scatter of the node shard
  (input P / k) and the all-gather of the updated weights (output P / k), at ``a`` bytes per element or, with
  int8, ``1 + 4 / block`` (an all-to-all of int8 values and fp32 scales instead of the reduce-scatter).

This mirrors what tests/distributed/test_hierarchical_zero.py counts on the simulated 2 x 2 x 2 topology.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron.config import ModelConfig
from megatron.topology import GCDS_PER_NODE

INT8_BLOCK = 256
"""Default ``zero_hierarchy_block`` (elements per fp32 scale)."""


def hierarchical_zero_collectives(add: Callable[..., None], model: ModelConfig, params: float, dtype_bytes: int,
                                  m: int, dp: int, tp: int, rank_of: Callable[[int], int], int8: bool) -> None:
    """Call ``add(group, op, phase, calls, payload_bytes, ranks)`` for every DP collective of one step (PP=1)."""
    a = dtype_bytes
    k = max(1, min(GCDS_PER_NODE // tp, dp))  # DP ranks on one node
    kp = 2 if tp == 1 and k >= 2 else 1  # DP ranks on one MI250X package
    package = [rank_of(d) for d in range(kp)]
    node = [rank_of(d) for d in range(0, k, kp)]
    network = [rank_of(d) for d in range(0, dp, k)]
    p = float(params)
    add("dp", "all_gather", "weights fwd (node)", m, p / kp * a, node)
    add("dp", "all_gather", "weights fwd (package)", m, p * a, package)
    released = max(0.0, p - model.word_embedding_parameters(tp) - model.position_parameters())
    add("dp", "all_gather", "weights bwd (node)", m, released / kp * a, node)
    add("dp", "all_gather", "weights bwd (package)", m, released * a, package)
    add("dp", "reduce_scatter", "grads (package)", m, p * a, package)
    add("dp", "reduce_scatter", "grads (node)", m, p / kp * a, node)
    wire = 1.0 + 4.0 / INT8_BLOCK if int8 else a
    add("dp", "all_to_all" if int8 else "reduce_scatter", "grads (network)", 1, p / k * wire, network)
    add("dp", "all_gather", "weights refresh (network)", 1, p / k * wire, network)
