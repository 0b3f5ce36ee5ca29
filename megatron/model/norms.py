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
    different slice of the sequence, so the (replicated) weight's gradient is summed over TP.

    ``one_plus`` (--apply-layernorm-1p): the weight is stored zero-centred and the norm scales by 1 + weight,
    added in the weight's dtype as upstream's MixedFusedLayerNorm does; the seam sees an ordinary weight, so every
    backend takes it. An input of another dtype than the weight (an fp32 residual stream, --fp32-residual-connection)
    is normalised in fp32 with fp32 weights and returned in the weight's dtype, the mixed-dtype form of apex's fused
    norms that Megatron-LM's flag relies on."""

    def __init__(self, hidden_size: int, kind: str, eps: float, *, tp: GroupInfo | None = None,
                 sequence_parallel: bool = False, backend: str = "auto", one_plus: bool = False) -> None:
        super().__init__()
        self.kind, self.eps, self.backend, self.one_plus = kind, eps, backend, one_plus
        self.tp = tp
        self.sequence_parallel = bool(sequence_parallel and tp is not None and tp.size > 1)
        # On the run's device like every other parameter (DeepSpeed would move them; our own engines do not).
        init = torch.zeros if one_plus else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=init_device()))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=init_device())) if kind == "layernorm" else None

    def _p(self, p: torch.Tensor | None) -> torch.Tensor | None:
        return sequence_parallel_param(p, self.tp) if (p is not None and self.sequence_parallel) else p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._p(self.weight), self._p(self.bias)
        if self.one_plus:
            weight = weight + 1
        out_dtype = weight.dtype
        if x.dtype != out_dtype:  # fp32 residual stream, 16-bit weights: all fp32, then the weights' dtype
            weight, bias = weight.float(), (bias.float() if bias is not None else None)
            x = x.float()
        if self.kind == "layernorm":
            y = norm_ops.layer_norm(x, weight, bias, self.eps, self.backend)
        else:
            y = norm_ops.rms_norm(x, weight, self.eps, self.backend)
        return y.to(out_dtype)
