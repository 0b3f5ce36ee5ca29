"""Tensor-parallel layers: VocabParallelEmbedding, ColumnParallelLinear, RowParallelLinear.

Activations are sequence-first ``[s, b, h]``. Linear layers return ``(output, bias)`` where ``bias``
is not None only with ``skip_bias_add`` (so the caller can fuse bias-add with the next op).

Initialisation is keyed per parameter (``init_key``) rather than drawn from a global RNG stream, so
that a layer initialises the same way whichever pipeline stage builds it. With
``use_cpu_initialization`` the full weight is drawn on CPU and sliced, giving identical full models
for every TP size; otherwise each rank draws only its own shard (cheaper, not layout-invariant).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

from megatron.core.parallel_state import GroupInfo
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.weight_grad_store import linear


def _stable_seed(seed: int, key: str, salt: int = 0) -> int:
    return (seed * 1_000_003 + zlib.crc32(key.encode()) * 97 + salt) % (2**63 - 1)


def init_device() -> torch.device:
    return torch.device(get_accelerator().current_device_name())


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int, stride: int = 1) -> None:
    """Tag a TP-sharded parameter the way DeepSpeed's grad-norm and checkpoint code look for it."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def mark_replicated(module: nn.Module) -> None:
    """A module built with a lone TP group inside a TP > 1 model (MoE experts without expert tensor parallelism)
    holds whole weights on every TP rank: its parameters count once in norms and are not TP shards in checkpoints."""
    for p in module.parameters():
        p.tensor_model_parallel = False


def initialize_shard(param: nn.Parameter, full_shape: tuple[int, ...], partition_dim: int, tp: GroupInfo,
                     std: float, seed: int, key: str, use_cpu_init: bool, stride: int = 1,
                     init_method: str = "normal") -> None:
    """Fill ``param`` (this rank's shard of a ``full_shape`` weight) from N(0, std), or with ``init_method``
    'xavier_uniform' (--init-method-xavier-uniform) from U(-a, a), a = sqrt(6 / (fan_in + fan_out)) of the full
    [out, in] weight: torch's ``xavier_uniform_`` of the full matrix, as upstream's --use-cpu-initialization path
    draws it (its GPU path would take the shard's fans, another distribution at every TP size).

    ``stride`` > 1 means the full weight is ``stride`` stacked blocks (e.g. SwiGLU's [gate; up]) and
    every rank takes its slice of each block, keeping gate and up rows aligned on each rank.
    """
    def draw(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32)
        if init_method == "xavier_uniform":
            bound = math.sqrt(6.0 / (full_shape[0] + full_shape[1]))
            return t.uniform_(-bound, bound, generator=gen)
        return t.normal_(0.0, std, generator=gen)

    with torch.no_grad():
        if tp.size == 1 or use_cpu_init:
            full = draw(full_shape, torch.Generator().manual_seed(_stable_seed(seed, key)))
            param.copy_(shard_tensor(full, partition_dim, tp.size, tp.rank, stride))
        else:
            param.copy_(draw(tuple(param.shape), torch.Generator().manual_seed(_stable_seed(seed, key,
                                                                                            salt=1 + tp.rank))))


def initialize_uniform(param: nn.Parameter, bound: float, seed: int, key: str) -> None:
    """Fill a replicated ``param`` from U(-bound, bound), keyed like ``initialize_shard`` (the same values on every
    rank and layout). torch.nn.Linear's default init is this with bound 1/sqrt(fan_in)."""
    with torch.no_grad():
        gen = torch.Generator().manual_seed(_stable_seed(seed, key))
        param.copy_(torch.empty(tuple(param.shape), dtype=torch.float32).uniform_(-bound, bound, generator=gen))


def shard_tensor(full: torch.Tensor, partition_dim: int, tp_size: int, tp_rank: int, stride: int = 1) -> torch.Tensor:
    """This TP rank's slice of a full tensor (each of ``stride`` stacked blocks split separately)."""
    if tp_size == 1:
        return full
    blocks = full.chunk(stride, dim=partition_dim)
    return torch.cat([b.chunk(tp_size, dim=partition_dim)[tp_rank] for b in blocks], dim=partition_dim)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocab rows are split across TP ranks; each rank looks up the ids it owns and
    the partial results are summed over TP. Output: [b, s, h] (the caller transposes)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: GroupInfo, init_std: float, seed: int,
                 init_key: str, use_cpu_init: bool = False, init_method: str = "normal",
                 fp32_lookup: bool = False) -> None:
        """``fp32_lookup`` (--embedding-weights-in-fp32): look up in an fp32 copy of the table and reduce over TP in
        fp32, then round to the weight's dtype (upstream casts the module to fp32 around the lookup)."""
        super().__init__()
        self.tp, self.fp32_lookup = tp, fp32_lookup
        self.num_embeddings = num_embeddings
        per_rank = num_embeddings // tp.size
        self.vocab_start, self.vocab_end = tp.rank * per_rank, (tp.rank + 1) * per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, device=init_device()))
        mark_tensor_parallel(self.weight, partition_dim=0)
        initialize_shard(self.weight, (num_embeddings, embedding_dim), 0, tp, init_std, seed, init_key, use_cpu_init,
                         init_method=init_method)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # An fp32 lookup's gradient reaches the weight through the cast's backward: rounded once to its dtype.
        weight = self.weight.float() if self.fp32_lookup else self.weight
        if self.tp.size == 1:
            out = F.embedding(ids, weight)
        else:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)
            out = mappings.reduce_from_tensor_model_parallel_region(out, self.tp)
        return out.to(self.weight.dtype)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its output dim: each rank computes Y[..., shard].

    ``defer_weight_grad`` (set by the pipeline model under zero-bubble H1): A's gradient can wait for the weight
    pass (megatron/core/tensor_parallel/weight_grad_store.py); a weight passed to ``forward`` never waits."""

    defer_weight_grad = False

    def __init__(self, input_size: int, output_size: int, *, tp: GroupInfo, bias: bool = True,
                 gather_output: bool = False, init_std: float = 0.02, seed: int = 0, init_key: str = "",
                 use_cpu_init: bool = False, stride: int = 1, sequence_parallel: bool = False,
                 skip_bias_add: bool = False, init_method: str = "normal") -> None:
        super().__init__()
        assert output_size % tp.size == 0, "caller validates divisibility"
        self.tp, self.gather_output, self.sequence_parallel = tp, gather_output, sequence_parallel and tp.size > 1
        self.skip_bias_add = skip_bias_add
        out_per_rank = output_size // tp.size
        self.weight = nn.Parameter(torch.empty(out_per_rank, input_size, device=init_device()))
        mark_tensor_parallel(self.weight, partition_dim=0, stride=stride)
        initialize_shard(self.weight, (output_size, input_size), 0, tp, init_std, seed, init_key, use_cpu_init,
                         stride, init_method)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_per_rank, device=init_device()))
            mark_tensor_parallel(self.bias, partition_dim=0, stride=stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None):
        """x: [s(/tp), b, in] -> ([s, b, out/tp], bias). ``weight`` overrides self.weight (tied output layer)."""
        w = self.weight if weight is None else weight
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x, self.tp)
        else:
            x = mappings.copy_to_tensor_model_parallel_region(x, self.tp)
        bias = None if self.skip_bias_add else self.bias
        y = linear(x, w, bias, self.defer_weight_grad and weight is None)
        if self.gather_output:
            y = mappings.gather_from_tensor_model_parallel_region(y, self.tp)
        return y, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its input dim: partial products are summed over TP (or
    reduce-scattered along the sequence with sequence parallelism). ``defer_weight_grad``: as ColumnParallelLinear's."""

    defer_weight_grad = False

    def __init__(self, input_size: int, output_size: int, *, tp: GroupInfo, bias: bool = True,
                 input_is_parallel: bool = True, init_std: float = 0.02, seed: int = 0, init_key: str = "",
                 use_cpu_init: bool = False, sequence_parallel: bool = False, skip_bias_add: bool = False,
                 init_method: str = "normal") -> None:
        super().__init__()
        assert input_size % tp.size == 0, "caller validates divisibility"
        self.tp, self.input_is_parallel = tp, input_is_parallel
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.skip_bias_add = skip_bias_add
        self.weight = nn.Parameter(torch.empty(output_size, input_size // tp.size, device=init_device()))
        mark_tensor_parallel(self.weight, partition_dim=1)
        initialize_shard(self.weight, (output_size, input_size), 1, tp, init_std, seed, init_key, use_cpu_init,
                         init_method=init_method)
        if bias:
            # Replicated on every TP rank; not marked TP so grad-norm counts it once.
            self.bias = nn.Parameter(torch.zeros(output_size, device=init_device()))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        """x: [s, b, in/tp] -> ([s(/tp), b, out], bias)."""
        if not self.input_is_parallel:
            x = mappings.scatter_to_tensor_model_parallel_region(x, self.tp)
        y = linear(x, self.weight, None, self.defer_weight_grad)
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_parallel_region(y, self.tp)
        else:
            y = mappings.reduce_from_tensor_model_parallel_region(y, self.tp)
        if self.bias is None:
            return y, None
        bias = sequence_parallel_param(self.bias, self.tp) if self.sequence_parallel else self.bias
        if self.skip_bias_add:
            return y, bias
        return y + bias, None


def sequence_parallel_param(p: torch.Tensor, tp: GroupInfo) -> torch.Tensor:
    """Use a replicated parameter on sequence-sharded activations: each TP rank sees a different
    slice of the sequence, so the parameter's gradient must be summed over TP. Doing it here, in
    autograd, keeps it independent of how DeepSpeed/ZeRO later reduce gradients."""
    return mappings.copy_to_tensor_model_parallel_region(p, tp)


def scaled_init_std(std: float, num_layers: int) -> float:
    """Megatron's output-layer init: std / sqrt(2 * num_layers)."""
    return std / math.sqrt(2.0 * num_layers)
