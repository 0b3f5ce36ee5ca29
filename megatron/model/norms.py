"""LayerNorm / RMSNorm modules over the kernel seam, sequence-parallel aware."""

from __future__ import annotations

import torch
from torch import nn

from megatron.core.parallel_state import GroupInfo
from megatron.core.tensor_parallel import sequence_parallel_param
from megatron.core.tensor_parallel.layers import init_device
from megatron.kernels import norms as norm_ops


class Norm(nn.Module):
    """``kind`` is 'layernorm' or 'rmsnorm'. With sequence parallelism each TP rank normalises a
    different slice of the sequence, so the (replicated) weight's gradient is summed over TP."""

    def __init__(self, hidden_size: int, kind: str, eps: float, *, tp: GroupInfo | None = None,
                 sequence_parallel: bool = False, backend: str = "auto") -> None:
        super().__init__()
        self.kind, self.eps, self.backend = kind, eps, backend
        self.tp = tp
        self.sequence_parallel = bool(sequence_parallel and tp is not None and tp.size > 1)
        # On the run's device like every other parameter (DeepSpeed would move them; our own engines do not).
        self.weight = nn.Parameter(torch.ones(hidden_size, device=init_device()))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=init_device())) if kind == "layernorm" else None

    def _p(self, p: torch.Tensor | None) -> torch.Tensor | None:
        return sequence_parallel_param(p, self.tp) if (p is not None and self.sequence_parallel) else p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layernorm":
            return norm_ops.layer_norm(x, self._p(self.weight), self._p(self.bias), self.eps, self.backend)
        return norm_ops.rms_norm(x, self._p(self.weight), self.eps, self.backend)
