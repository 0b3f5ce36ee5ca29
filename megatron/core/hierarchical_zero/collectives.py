"""Hierarchical reduce-scatter / all-gather over a rank's tiers, and their int8 network variants.

Everything goes through megatron/core/comm.py, so its observers (the byte counters) see every call. The int8
reduce-scatter follows ZeRO++'s qgZ idea: integers cannot be summed on the wire, so each rank quantises its whole
buffer, an all-to-all hands every rank the quantised copies of its own slice, and the sum happens after
dequantising, in fp32. Error feedback keeps what quantisation dropped and adds it to the next step's gradient,
so the error does not accumulate over steps.
"""

from __future__ import annotations

import torch

from megatron.core import comm
from megatron.core.hierarchical_zero.groups import Level
from megatron.core.hierarchical_zero.quant import dequantize, quantize


def reduce_scatter_levels(x: torch.Tensor, levels: list[Level]) -> torch.Tensor:
    """Sum over every level's group, fastest first; returns this rank's chunk [n / prod(sizes)]."""
    for lv in levels:
        x = comm.reduce_scatter(x, lv.group)  # [n] -> [n / lv.size]
    return x


def all_gather_levels(x: torch.Tensor, levels: list[Level]) -> torch.Tensor:
    """Inverse of ``reduce_scatter_levels``' chunking: gather over the slowest level first (smallest data)."""
    for lv in reversed(levels):
        x = comm.all_gather(x, lv.group)  # [m] -> [m * lv.size]
    return x


def quantized_reduce_scatter(x: torch.Tensor, level: Level, block: int, residual: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` [n] over ``level`` with int8 on the wire; returns this rank's slice [n / size] in fp32.

    ``residual`` [n] (fp32) is the error feedback: read (added before quantising) and updated in place.
    """
    y = x.float() + residual
    q, scale = quantize(y, block)  # [n] int8, [n / block] fp32
    residual.copy_(y - dequantize(q, scale, block))
    q_in = comm.all_to_all(q, level.group)  # [n]: chunk j is rank j's quantised copy of my slice
    s_in = comm.all_to_all(scale, level.group)  # [n / block], chunked the same way (slices are whole blocks)
    return dequantize(q_in, s_in, block).view(level.size, -1).sum(dim=0)  # (size, n/size) -> [n/size]


def quantized_all_gather(x: torch.Tensor, level: Level, block: int) -> torch.Tensor:
    """All-gather of ``x`` [m] over ``level`` with int8 on the wire; returns [m * size] in fp32.

    Every rank, this one included, gets the dequantised values, so all replicas compute with identical weights;
    the fp32 master copy stays exact, so the rounding never compounds from step to step.
    """
    q, scale = quantize(x, block)
    return dequantize(comm.all_gather(q, level.group), comm.all_gather(scale, level.group), block)
