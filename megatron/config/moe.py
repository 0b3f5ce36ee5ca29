"""Mixture of experts (DeepSpeed-MoE, as upstream Megatron-DeepSpeed builds it): which layers have experts, the gate
and its capacity, the load-balancing loss. Field names follow upstream's flags (dashes -> underscores)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.errors import ConfigError
from megatron.flag_bounds import check_fields

# Fields with a row in megatron/flag_bounds.py, and the flag that sets each.
_BOUNDED = {f: "--" + f.replace("_", "-") for f in (
    "num_experts", "expert_interval", "topk", "moe_train_capacity_factor", "moe_eval_capacity_factor",
    "moe_min_capacity", "moe_loss_coeff")}


@dataclass(frozen=True)
class MoEConfig:
    """The MoE settings of a model; the default (one expert) is the dense model."""

    num_experts: tuple[int, ...] = (1,)
    """--num-experts: one count for every MoE layer, or one per MoE layer (num_layers // expert_interval values);
    a count of 1 leaves that layer dense."""
    expert_interval: int = 2
    """--expert-interval: every expert_interval-th layer (1-based: layers 2, 4, ... by default) is an MoE layer."""
    topk: int = 1
    """--topk: experts per token (1: top-1 gating with random token selection; 2: top-2 gating; more: DeepSpeed's
    top-k gating, whose capacity keeps the largest gates)."""
    mlp_type: str = "standard"
    """--mlp-type: 'standard', or 'residual' (PR-MoE: a dense MLP beside the experts, mixed by a learned
    coefficient)."""
    moe_train_capacity_factor: float = 1.0
    moe_eval_capacity_factor: float = 1.0
    moe_min_capacity: int = 4
    moe_token_dropping: bool = True
    """False (--disable-moe-token-dropping): each expert's capacity is the largest count any expert-parallel rank
    routes to one expert, so no token is dropped."""
    moe_loss_coeff: float = 0.1
    """The load-balancing loss of each MoE layer, summed over the layers, times this, is added to the lm loss."""
    moe_top2_2nd_expert_sampling: bool = True
    """Top-2: the second expert is drawn by Gumbel-max sampling from the gate's logits (False: the second largest)."""
    use_rts: bool = True
    """Top-1: random token selection decides which tokens an over-full expert keeps (DeepSpeed's default; upstream
    has no flag for it)."""
    enable_expert_tensor_parallelism: bool = False
    """The experts are split over the TP group like the dense MLP (else every TP rank holds whole experts)."""

    @property
    def enabled(self) -> bool:
        return any(n > 1 for n in self.num_experts)

    def experts_per_layer(self, num_layers: int) -> list[int]:
        """Expert count of every layer (1 = dense), upstream's get_num_experts_per_layer."""
        moe_layers = num_layers // self.expert_interval
        counts = list(self.num_experts) * moe_layers if len(self.num_experts) == 1 else list(self.num_experts)
        return [counts[(n - 1) // self.expert_interval] if n % self.expert_interval == 0 else 1
                for n in range(1, num_layers + 1)]

    def validate(self, num_layers: int, tokens_per_micro_batch: int) -> None:
        """Checks of the MoE settings alone; the layout's (EP, TP, PP, ZeRO) are in RunConfig.validate."""
        check_fields(self, _BOUNDED)
        if not self.enabled:
            return
        moe_layers = num_layers // self.expert_interval
        if len(self.num_experts) not in (1, moe_layers):
            raise ConfigError(f"--num-experts gives {len(self.num_experts)} counts but --num-layers {num_layers} with "
                              f"--expert-interval {self.expert_interval} has {moe_layers} MoE layers: give one count "
                              f"or {moe_layers}")
        if self.mlp_type not in ("standard", "residual"):
            raise ConfigError(f"--mlp-type {self.mlp_type!r}: choose 'standard' or 'residual'")
        fewest = min(n for n in self.num_experts if n > 1)
        if self.topk > fewest:
            raise ConfigError(f"--topk {self.topk} exceeds the {fewest} experts of an MoE layer (--num-experts): use "
                              f"--topk <= {fewest}")
        if self.topk == 1 and tokens_per_micro_batch < self.moe_min_capacity:
            # DeepSpeed's top-1 gate asserts it at the first step: say it now.
            raise ConfigError(f"--moe-min-capacity {self.moe_min_capacity} exceeds the {tokens_per_micro_batch} tokens "
                              "of a micro-batch (--micro-batch-size x --seq-length), which top-1 gating needs: lower "
                              "--moe-min-capacity or raise the micro-batch")
