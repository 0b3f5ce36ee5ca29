"""Where a flat range of one TP shard of a parameter sits in the shards of another TP layout: pure index arithmetic
(no I/O), as 2-D block copies between flat buffers, so that a rank reads only the bytes of the range it holds.

A parameter split over TP on dimension ``dim`` with ``stride`` stacked blocks (megatron/core/tensor_parallel's
``shard_tensor``) is seen as ``[O, D, I]`` (``O``: the dimensions before ``dim``, ``I``: those after). Rank ``r`` of
``T`` holds, of each block ``k``, the rows ``[(k T + r) c, (k T + r + 1) c)`` of ``D`` (``c = D / (stride T)``); its
shard is ``[O, D / T, I]``. Along one ``o`` a run of ``D``-rows is contiguous in the full tensor and in both shards,
so a flat range maps to a few blocks of equal rows, whatever the two TP sizes (any pair whose sizes divide ``D``).
Vocabulary rows may be padded to another size on each side: rows one side lacks are not copied (the target's stay as
the caller set them, zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Split:
    """How one side cuts a parameter over TP: its full ``shape`` (vocabulary rows padded as that side pads them),
    the partition ``dim`` (None: every TP rank holds it whole), ``stride`` blocks, over ``tp`` ranks."""

    shape: tuple[int, ...]
    dim: int | None
    stride: int = 1
    tp: int = 1

    def _odi(self) -> tuple[int, int, int, int]:
        """(O, D, I, ranks the dimension is cut over)."""
        if self.dim is None:
            return 1, math.prod(self.shape), 1, 1
        return (math.prod(self.shape[:self.dim]), self.shape[self.dim], math.prod(self.shape[self.dim + 1:]),
                self.tp)

    def shard_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(self.shape)
        return tuple(n // self.tp if i == self.dim else n for i, n in enumerate(self.shape))

    def shard_numel(self) -> int:
        return math.prod(self.shard_shape())


@dataclass(frozen=True)
class Block:
    """``rows`` copies of ``length`` elements: source shard ``src_rank``'s flat elements ``src + i * src_stride ...``
    to the target shard's ``dst + i * dst_stride ...``."""

    src_rank: int
    src: int
    src_stride: int
    dst: int
    dst_stride: int
    rows: int
    length: int

    def numel(self) -> int:
        return self.rows * self.length


def blocks(target: Split, rank: int, a: int, b: int, source: Split) -> list[Block]:
    """The copies that fill target shard ``rank``'s flat range ``[a, b)`` from the source's shards (a replicated
    parameter from source rank ``rank % source.tp``)."""
    if a >= b:
        return []
    o_t, d_t, inner, t_tp = target._odi()
    o_s, d_s, inner_s, s_tp = source._odi()
    if (o_t, inner) != (o_s, inner_s) or target.stride != source.stride:
        raise ValueError(f"incompatible splits {target} and {source}")
    stride = target.stride
    c_t, c_s = d_t // (stride * t_tp), d_s // (stride * s_tp)
    w_t, w_s = d_t // t_tp * inner, d_s // s_tp * inner  # one o's elements in a target / source shard
    t = rank if target.dim is not None else 0
    src_ranks = range(s_tp) if source.dim is not None else [rank % source.tp]
    out = []
    for o0, o1, lo, hi in _segments(a, b, w_t):
        for k in range(stride):
            x0, x1 = max(lo, k * c_t * inner), min(hi, (k + 1) * c_t * inner)  # in this o, target block k
            if x0 >= x1:
                continue
            f0 = (k * t_tp + t) * c_t * inner + x0 - k * c_t * inner  # the same elements in the full tensor's o
            f1 = f0 + x1 - x0
            for j in src_ranks:
                jj = j if source.dim is not None else 0
                for ks in range(stride):
                    base = (ks * s_tp + jj) * c_s * inner
                    g0, g1 = max(f0, base), min(f1, base + c_s * inner)
                    if g0 < g1:
                        out.append(Block(j, o0 * w_s + g0 - base + ks * c_s * inner, w_s,
                                         o0 * w_t + x0 + g0 - f0, w_t, o1 - o0, g1 - g0))
    return out


def _segments(a: int, b: int, width: int) -> list[tuple[int, int, int, int]]:
    """``[a, b)`` of a buffer of rows of ``width``: (first row, end row, start, end within each row), a partial head
    row, the whole rows, a partial tail row."""
    first, last = a // width, (b - 1) // width
    if first == last:
        return [(first, first + 1, a - first * width, b - first * width)]
    out, lo, hi = [], first, last + 1
    if a % width:
        out.append((first, first + 1, a % width, width))
        lo = first + 1
    if b % width:
        hi = last
    if lo < hi:
        out.append((lo, hi, 0, width))
    if b % width:
        out.append((last, last + 1, 0, b - last * width))
    return out


def clip(block: Block, lo: int, hi: int) -> list[Block]:
    """The parts of ``block`` whose source elements lie in ``[lo, hi)`` (one piece of the source shard): a partial
    first row, the whole rows, a partial last row."""
    s, n = block.src_stride, block.length
    i0 = max(0, _ceil_div(lo - block.src - n + 1, s))  # the first row that ends after lo
    i1 = min(block.rows - 1, (hi - 1 - block.src) // s)  # the last row that starts before hi
    if i0 > i1:
        return []
    if i0 == i1:
        return _clip_row(_row(block, i0), lo, hi)
    head, tail = _row(block, i0), _row(block, i1)
    whole_head, whole_tail = head.src >= lo, tail.src + n <= hi  # rows in between lie inside (s >= n)
    start, end = (i0 if whole_head else i0 + 1), (i1 + 1 if whole_tail else i1)
    out = [] if whole_head else _clip_row(head, lo, hi)
    if start < end:
        out.append(replace(block, src=block.src + start * s, dst=block.dst + start * block.dst_stride,
                           rows=end - start))
    return out + ([] if whole_tail else _clip_row(tail, lo, hi))


def _clip_row(row: Block, lo: int, hi: int) -> list[Block]:
    a, b = max(row.src, lo), min(row.src + row.length, hi)
    return [replace(row, src=a, dst=row.dst + a - row.src, length=b - a)] if a < b else []


def _row(block: Block, i: int) -> Block:
    return replace(block, src=block.src + i * block.src_stride, dst=block.dst + i * block.dst_stride, rows=1)


def _ceil_div(x: int, y: int) -> int:
    return -(-x // y)


def copy(block: Block, dst: torch.Tensor, dst_start: int, src: torch.Tensor, src_start: int) -> None:
    """Copy ``block`` from the flat ``src`` (the source shard's elements from ``src_start`` on) into the flat ``dst``
    (the target shard's from ``dst_start`` on), casting to ``dst``'s dtype."""
    out = dst.as_strided((block.rows, block.length), (block.dst_stride, 1),
                         dst.storage_offset() + block.dst - dst_start)
    out.copy_(src.as_strided((block.rows, block.length), (block.src_stride, 1),
                             src.storage_offset() + block.src - src_start))
