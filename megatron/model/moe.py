"""The mixture-of-experts MLP of a transformer layer, DeepSpeed-MoE as upstream Megatron-DeepSpeed builds it: a top-1
or top-2 gate over experts split across the expert-parallel ranks, and PR-MoE's residual MLP (--mlp-type residual)."""

from __future__ import annotations

import math

import torch
from deepspeed.moe.layer import MoE as _DeepSpeedMoE
from torch import nn

from megatron.config import ModelConfig
from megatron.core.parallel_state import GroupInfo
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from megatron.core.tensor_parallel.layers import init_device, initialize_uniform, mark_replicated
from megatron.model.mlp import MLP
from megatron.model.moe_experts import RoutedExperts, expert_group_name


class MoE(_DeepSpeedMoE):
    """Input [s(/tp with SP), b, h] -> (output of the same shape, None); the layer's load-balancing loss is left in
    ``aux_loss`` (GPTModel adds them up).

    DeepSpeed's MoE is the base class only as the mark its engine looks for (``isinstance``): with it the engine
    reduces the experts' gradients over their replicas, ZeRO-1/2 shards them there and checkpoints write upstream's
    per-expert files. None of DeepSpeed's layer runs: __init__, forward and set_deepspeed_parallelism are ours, and
    the attributes its engine reads (num_experts, num_local_experts, expert_group_name) are set here.

    The gate and the dispatch see every token of the micro-batch, as one process does (with sequence parallelism the
    sequence is gathered first): capacity, dropping and the balancing loss do not depend on the layout.
    """

    def __init__(self, cfg: ModelConfig, layer_number: int, num_experts: int, *, tp: GroupInfo, ep: GroupInfo,
                 sequence_parallel: bool, init_seed: int) -> None:
        nn.Module.__init__(self)  # not DeepSpeed's MoE.__init__, which builds its own gate and experts
        self.num_experts = num_experts
        self.ep_size = ep.size
        self.num_local_experts = num_experts // ep.size
        self.expert_group_name = expert_group_name(ep.size)
        self.tp, self.sequence_parallel = tp, sequence_parallel and tp.size > 1
        self.deepspeed_moe = RoutedExperts(cfg, layer_number, num_experts, tp=tp, ep=ep, init_seed=init_seed)
        self.use_residual = cfg.moe.mlp_type == "residual"
        if self.use_residual:
            # PR-MoE: upstream's residual MLP is its expert template, split over TP only with expert TP.
            expert_tp = cfg.moe.enable_expert_tensor_parallelism
            self.mlp = MLP(cfg, layer_number, tp=tp if expert_tp else GroupInfo([0], 0, None), sequence_parallel=False,
                           init_seed=init_seed, init_prefix=f"layers.{layer_number}.mlp.residual")
            if not expert_tp:
                mark_replicated(self.mlp)
            self.coefficient = nn.Linear(cfg.hidden_size, 2, device=init_device())
            bound = 1.0 / math.sqrt(cfg.hidden_size)  # torch.nn.Linear's default, keyed
            for name, p in self.coefficient.named_parameters():
                initialize_uniform(p, bound, init_seed, f"layers.{layer_number}.mlp.coefficient.{name}")
        self.aux_loss: torch.Tensor | None = None

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's engine calls this to create the expert groups: ours already exist (megatron/engine.py
        registers them under ``expert_group_name``)."""

    def forward(self, x: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, None]:
        """x [s(/tp), b, h]; keys [s, b]: the tokens' random-draw keys (megatron/core/moe/draws.py)."""
        if self.sequence_parallel:  # the same tokens on every TP rank, as without SP: split back at the end
            x = gather_from_sequence_parallel_region(x, self.tp, reduce_grad=False)  # [s, b, h]
        s, b, h = x.shape
        out, self.aux_loss = self.deepspeed_moe(x.reshape(s * b, h), keys.reshape(-1))  # [s * b, h]: s-major
        out = out.view(s, b, h)
        if self.use_residual:
            dense, bias = self.mlp(x)
            dense = dense if bias is None else dense + bias
            coef = torch.softmax(self.coefficient(x), dim=-1)  # [s, b, 2]
            out = out * coef[..., 0:1] + dense * coef[..., 1:]
        if self.sequence_parallel:
            out = scatter_to_sequence_parallel_region(out, self.tp)  # [s/tp, b, h]
        return out, None
