"""Block-wise symmetric int8 quantisation in plain PyTorch (runs on CPU; DeepSpeed's qwZ/qgZ kernels do not).

Each block of ``block`` elements keeps one fp32 scale, max|x| / 127, so the error of an element is at most half
a step of its own block (outliers in one block do not flatten the others). Wire cost per element:
1 + 4 / block bytes (1.016 at block 256) instead of 2 (bf16) or 4 (fp32).
"""

from __future__ import annotations

import torch

QMAX = 127.0


def quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [n], fp32 scales [n / block]) of a 1-D tensor whose length is a multiple of ``block``."""
    blocks = x.float().view(-1, block)  # (n/block, block)
    scale = blocks.abs().amax(dim=1).clamp(min=1e-30) / QMAX  # (n/block,)
    q = torch.round(blocks / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.view(-1), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 values [n] back from ``quantize``'s output."""
    return (q.view(-1, block).float() * scale[:, None]).view(-1)


def wire_bytes_per_element(block: int) -> float:
    return 1.0 + 4.0 / block
