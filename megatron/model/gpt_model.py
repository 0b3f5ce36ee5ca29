"""GPT (GPT-2 and Llama variants) built from tensor-parallel layers. Takes config objects only."""

from __future__ import annotations

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.core.parallel_state import GroupInfo
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    gather_from_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)
from megatron.core.moe.draws import token_keys
from megatron.core.tensor_parallel.recompute import CheckpointOptions, checkpoint_with
from megatron.core.ulysses import position_ids as sequence_position_ids
from megatron.model.compile import compile_transformer_layers
from megatron.model.embedding import Embedding
from megatron.model.norms import Norm
from megatron.model.transformer import TransformerLayer


class GPTModel(nn.Module):
    """tokens [b, s] -> per-token loss [b, s] (fp32) when labels are given, else vocab-parallel
    logits [b, s, V/tp]. With DeepSpeed-Ulysses (``ulysses``) tokens and labels are this SP rank's slice [b, s/SP].

    With mixture-of-experts layers (``cfg.moe``, experts split over ``ep``) each forward leaves the scaled sum of their
    load-balancing losses for ``take_moe_loss``; ``sample_index`` [b] (the samples' indices in the data set) keys the
    gates' random draws, so they follow the tokens, not the layout."""

    def __init__(self, cfg: ModelConfig, *, tp: GroupInfo, sequence_parallel: bool = False,
                 init_seed: int = 1234, ulysses: GroupInfo | None = None, ep: GroupInfo | None = None) -> None:
        super().__init__()
        self.cfg, self.tp, self.init_seed = cfg, tp, init_seed
        self.ulysses = ulysses if ulysses is not None else GroupInfo([0], 0, None)
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.padded_vocab_size = cfg.padded_vocab_size(tp.size)
        common = dict(tp=tp, sequence_parallel=self.sequence_parallel, init_seed=init_seed)
        self.embedding = Embedding(cfg, self.padded_vocab_size, **common)
        self.layers = nn.ModuleList(TransformerLayer(cfg, i, **common, ulysses=self.ulysses, num_experts=n, ep=ep)
                                    for i, n in enumerate(cfg.layer_experts()))
        self.moe_layers = [layer.mlp for layer in self.layers if layer.is_moe]
        self._moe_loss: torch.Tensor | None = None
        self.final_layernorm = Norm(cfg.hidden_size, cfg.normalization, cfg.layernorm_epsilon, tp=tp,
                                    sequence_parallel=self.sequence_parallel, backend=cfg.attention_backend,
                                    one_plus=cfg.apply_layernorm_1p)
        self.output_layer = OutputLayer(cfg, self.padded_vocab_size, **common)
        self.segments = recompute_segments(cfg)
        self.checkpoint_options = checkpoint_options(cfg, self.sequence_parallel)
        compile_transformer_layers(self, cfg.torch_compile)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, sample_index: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None and self.ulysses.size > 1:  # learned positions are global (RoPE is, after all-to-all)
            position_ids = sequence_position_ids(tokens.shape[1], self.ulysses, tokens.device)
        keys = self._token_keys(tokens, sample_index)
        x = self.embedding(tokens, position_ids)  # [s(/SP)(/tp), b, h]
        for start, end, recompute in self.segments:
            run = self._layers(start, end, keys)
            if self.training and recompute:  # keeps only the segment's input [s, b, h] (or 1/TP of it)
                x = checkpoint_with(run, x, self.checkpoint_options, self.tp.group, self.tp.size)
            else:
                x = run(x)
        if self.moe_layers:
            self._moe_loss = self.cfg.moe.moe_loss_coeff * torch.stack([m.aux_loss for m in self.moe_layers]).sum()
        x = self.final_layernorm(x)
        tied = self.embedding.word_embeddings.weight if self.cfg.tie_embeddings else None
        return self.output_layer(x, labels, tied)


    def _layers(self, start: int, end: int, keys: torch.Tensor | None):
        """Layers [start, end) as one function of x; a recompute calls it again with the same ``keys``."""
        if keys is None and end == start + 1:
            return self.layers[start]

        def run(x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers[start:end]:
                x = layer(x, keys)
            return x

        return run

    def _token_keys(self, tokens: torch.Tensor, sample_index: torch.Tensor | None) -> torch.Tensor | None:
        """[s, b] draw keys of the tokens for the MoE gates (None without MoE layers). Without ``sample_index``
        (a forward outside the data loader) the micro-batch's own order stands in for it."""
        if not self.moe_layers:
            return None
        if sample_index is None:
            sample_index = torch.arange(tokens.shape[0], device=tokens.device)
        return token_keys(sample_index, tokens.shape[1], self.init_seed)

    def take_moe_loss(self) -> torch.Tensor | None:
        """The last forward's MoE loss: --moe-loss-coeff x the sum of its layers' load-balancing losses (a float32
        scalar in the graph, to add to the lm loss), or None without MoE layers. Taken once."""
        loss, self._moe_loss = self._moe_loss, None
        return loss


class OutputLayer(nn.Module):
    """Final projection to vocab-parallel logits (optionally with the tied input embedding) + loss."""

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, *, tp: GroupInfo, sequence_parallel: bool,
                 init_seed: int) -> None:
        super().__init__()
        self.tp = tp
        self.linear = ColumnParallelLinear(
            cfg.hidden_size, padded_vocab_size, tp=tp, bias=False, init_std=cfg.init_method_std, seed=init_seed,
            init_key="output_layer", use_cpu_init=cfg.use_cpu_initialization, sequence_parallel=sequence_parallel,
            init_method=cfg.init_method)
        if cfg.tie_embeddings:
            del self.linear.weight  # the embedding owns the weight; forward receives it
            self.linear.weight = None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None, tied_weight: torch.Tensor | None):
        """x: [s(/tp), b, h]; labels: [b, s]."""
        logits, _ = self.linear(x, weight=tied_weight)  # [s, b, V/tp]
        if labels is None:
            return logits.transpose(0, 1)  # [b, s, V/tp]
        # The loss walks [s, b, V/tp] in contiguous chunks of positions (no fp32 copy of all logits).
        return vocab_parallel_cross_entropy(logits, labels.t(), self.tp).t()  # [b, s]


def recompute_segments(cfg: ModelConfig) -> list[tuple[int, int, bool]]:
    """(start, end, recompute) runs of layers: the first ``recompute_layer_count`` layers in checkpoints of
    ``checkpoint_chunk_layers`` (upstream's uniform method; the last chunk may be shorter), the rest plain."""
    n, k = cfg.num_layers, recompute_layer_count(cfg)
    step = cfg.checkpoint_chunk_layers
    segments = [(i, min(i + step, k), True) for i in range(0, k, step)]
    return segments + [(i, i + 1, False) for i in range(k, n)]


def checkpoint_options(cfg: ModelConfig, sequence_parallel: bool = False) -> CheckpointOptions:
    """With sequence parallelism each rank's layer input is already its own 1/TP: nothing left to partition."""
    return CheckpointOptions(partition=cfg.recompute_partition and not sequence_parallel, cpu=cfg.recompute_on_cpu,
                             synchronize=cfg.recompute_synchronize, profile=cfg.recompute_profile)


def recompute_layer_count(cfg: ModelConfig, num_layers: int | None = None) -> int:
    """How many of ``num_layers`` (default: all; a pipeline stage passes its own) get full recompute."""
    n = cfg.num_layers if num_layers is None else num_layers
    if cfg.recompute_granularity != "full":
        return 0
    return n if cfg.recompute_num_layers is None else min(cfg.recompute_num_layers, n)


def gather_logits(logits: torch.Tensor, tp: GroupInfo) -> torch.Tensor:
    """Vocab-parallel [b, s, V/tp] -> full [b, s, V] on every TP rank (tests, generation, export)."""
    return gather_from_tensor_model_parallel_region(logits, tp)
