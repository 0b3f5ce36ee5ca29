"""Megatron's tensor-parallel vocabulary: layers, region mappings, vocab-parallel cross entropy."""

from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    sequence_parallel_param,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "sequence_parallel_param",
    "vocab_parallel_cross_entropy", "copy_to_tensor_model_parallel_region", "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
]
