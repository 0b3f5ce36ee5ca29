"""Input embedding: vocab-parallel word embedding + optional learned positions -> [s, b, h]."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.core.parallel_state import GroupInfo
from megatron.core.tensor_parallel import VocabParallelEmbedding, scatter_to_sequence_parallel_region
from megatron.core.tensor_parallel.layers import init_device, initialize_shard
from megatron.core.tensor_parallel.random import get_rng_tracker


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, *, tp: GroupInfo, sequence_parallel: bool = False,
                 init_seed: int = 1234) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size, cfg.hidden_size, tp=tp, init_std=cfg.init_method_std, seed=init_seed,
            init_key="embedding.word", use_cpu_init=cfg.use_cpu_initialization, init_method=cfg.init_method,
            fp32_lookup=cfg.embedding_weights_in_fp32)
        if cfg.position_embedding_type == "learned_absolute":
            # Replicated on every TP rank (small), so initialise the full table on every rank.
            self.position_embeddings = nn.Parameter(
                torch.empty(cfg.max_position_embeddings, cfg.hidden_size, device=init_device()))
            full = GroupInfo([0], 0, None)
            initialize_shard(self.position_embeddings, tuple(self.position_embeddings.shape), 0, full,
                             cfg.init_method_std, init_seed, "embedding.position", True, init_method=cfg.init_method)
        else:
            self.register_parameter("position_embeddings", None)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: [b, s] -> [s(/tp with SP), b, h]."""
        x = self.word_embeddings(tokens)  # [b, s, h]
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
            x = x + F.embedding(position_ids, self.position_embeddings)
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        if self.cfg.fp32_residual_connection:  # the residual stream starts here, before dropout (as upstream)
            x = x.float()
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp)
        p = self.cfg.hidden_dropout if self.training else 0.0
        if p > 0.0:
            ctx = get_rng_tracker().fork() if self.sequence_parallel else contextlib.nullcontext()
            with ctx:
                x = F.dropout(x, p=p, training=True)
        return x
