"""The TP arithmetic of resuming at another layout (megatron/checkpointing/relayout/coords.py), against
``shard_tensor`` itself: any flat range of a target shard, assembled from the source's shards cut into arbitrary
pieces (as ZeRO partitions cut them), equals the target's own shard of the full tensor; vocabulary rows padded to
another size are copied where both sides have them and left alone elsewhere."""

import random

import pytest
import torch

from megatron.checkpointing.relayout.coords import Split, blocks, clip, copy
from megatron.core.tensor_parallel.layers import shard_tensor


def _assemble(full_t: torch.Tensor, full_s: torch.Tensor, dim, stride, t_tp, s_tp, rank, a, b, cuts, rng):
    target, source = Split(tuple(full_t.shape), dim, stride, t_tp), Split(tuple(full_s.shape), dim, stride, s_tp)
    shards = [shard_tensor(full_s, dim, s_tp, j, stride).reshape(-1) if dim is not None else full_s.reshape(-1)
              for j in range(s_tp)]
    out = torch.full((b - a,), -1.0)
    copied = 0
    for bl in blocks(target, rank, a, b, source):
        flat = shards[bl.src_rank]
        bounds = sorted({0, flat.numel(), *rng.sample(range(1, flat.numel()), min(cuts, flat.numel() - 1))})
        for lo, hi in zip(bounds, bounds[1:], strict=False):  # the source shard in pieces, each its own tensor
            piece = flat[lo:hi].clone()
            for part in clip(bl, lo, hi):
                copy(part, out, a, piece, lo)
                copied += part.numel()
    return out, copied


@pytest.mark.parametrize("seed", range(40))
def test_any_range_of_any_tp_layout_from_any_other(seed):
    rng = random.Random(seed)
    dim = rng.choice([None, 0, 1])
    stride = 1 if dim is None else rng.choice([1, 2, 3])
    t_tp, s_tp = rng.choice([1, 2, 4]), rng.choice([1, 2, 4])
    cut = stride * 4  # D divisible by stride x every TP size
    shape = [rng.randint(1, 3) * cut if i == (dim or 0) else rng.randint(1, 5) for i in range(rng.choice([1, 2, 3]))]
    if dim == 1 and len(shape) < 2:
        shape.append(cut)
    full = torch.randn(shape)
    rank = rng.randrange(t_tp) if dim is not None else rng.randrange(4)
    want = (shard_tensor(full, dim, t_tp, rank, stride) if dim is not None else full).reshape(-1)
    a = rng.randrange(want.numel())
    b = rng.randrange(a + 1, want.numel() + 1)
    got, copied = _assemble(full, full, dim, stride, t_tp if dim is not None else 1, s_tp, rank, a, b,
                            rng.randint(0, 6), rng)
    assert copied == b - a
    assert torch.equal(got, want[a:b]), (dim, stride, t_tp, s_tp, shape, rank, a, b)


@pytest.mark.parametrize("t_tp,s_tp", [(1, 2), (2, 1), (4, 2), (2, 4)])
def test_vocabulary_rows_padded_otherwise(t_tp, s_tp):
    """200 true rows padded to 32 x TP on each side: rows both sides have are copied, the target's extra rows are
    left alone (zero), the source's extra rows are not read."""
    rng = random.Random(t_tp * 10 + s_tp)
    pad = [((200 + 32 * t - 1) // (32 * t)) * 32 * t for t in (t_tp, s_tp)]
    true = torch.randn(200, 8)
    full_t, full_s = (torch.cat([true, torch.randn(p - 200, 8)]) for p in pad)
    for rank in range(t_tp):
        n = pad[0] // t_tp * 8
        got, _ = _assemble(full_t, full_s, 0, 1, t_tp, s_tp, rank, 0, n, 3, rng)
        rows = got.view(-1, 8)
        first = rank * pad[0] // t_tp
        for i, row in enumerate(rows):
            g = first + i
            if g < min(pad):
                assert torch.equal(row, full_s[g])
            else:
                assert torch.equal(row, torch.full((8,), -1.0))


def test_clip_splits_rows_at_piece_bounds():
    from megatron.checkpointing.relayout.coords import Block

    bl = Block(0, src=3, src_stride=10, dst=0, dst_stride=4, rows=5, length=4)  # rows at 3, 13, 23, 33, 43
    parts = clip(bl, 15, 36)
    assert [(p.src, p.dst, p.rows, p.length) for p in parts] == [(15, 6, 1, 2), (23, 8, 1, 4), (33, 12, 1, 3)]
    assert sum(p.numel() for p in clip(bl, 0, 100)) == 20 and len(clip(bl, 0, 100)) == 1
    assert clip(bl, 7, 13) == [] and clip(bl, 47, 100) == []
