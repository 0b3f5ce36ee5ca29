"""An MoE layer's gate and experts, and one routed pass over them: gate, dispatch, all-to-all, experts, all-to-all,
combine. Module names are upstream's (``deepspeed_moe.gate.wg``, ``deepspeed_moe.experts.deepspeed_experts.N``), the
names its checkpoints and DeepSpeed's per-expert files use."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.core import comm
from megatron.core.moe import draws, gating
from megatron.core.moe.dispatch import combine, dispatch, route_slots
from megatron.core.moe.mappings import all_to_all, gather_capacity, split_capacity
from megatron.core.parallel_state import GroupInfo
from megatron.core.tensor_parallel.layers import init_device, initialize_uniform, mark_replicated
from megatron.model.mlp import MLP


def expert_group_name(ep_size: int) -> str:
    """The name DeepSpeed files expert parameters and their groups under (deepspeed.moe.layer.MoE's)."""
    return f"ep_size_{ep_size}"


class TopKGate(nn.Module):
    """The router: logits = x W^T with W [E, h] replicated everywhere (a dense parameter), computed in fp32 as
    DeepSpeed's TopKGate; initialised as its torch.nn.Linear, U(+-1/sqrt(h)), but keyed (layout-independent)."""

    def __init__(self, hidden_size: int, num_experts: int, *, seed: int, key: str) -> None:
        super().__init__()
        self.wg = nn.Linear(hidden_size, num_experts, bias=False, device=init_device())
        initialize_uniform(self.wg.weight, 1.0 / math.sqrt(hidden_size), seed, key)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [S, h] -> logits [S, E] float32."""
        return F.linear(tokens.float(), self.wg.weight.float())


class Experts(nn.Module):
    """This EP rank's experts, each the dense MLP (split over TP only with --enable-expert-tensor-parallelism) with
    its own initialisation key (upstream deep-copies one MLP, so its experts start equal).

    Their parameters carry DeepSpeed's MoE marks (``allreduce=False``, ``group_name``): its engine and ZeRO reduce and
    shard them over the expert-replica group, and its checkpoints write one file per expert.

    Whole experts under TP > 1 run on this TP rank's 1/TP of the slots only, so each TP rank's gradient is a part of
    the expert's: a hook sums it over TP before it is accumulated (every micro-batch, the weights' bytes over TP). The
    expert-replica group holds no TP peer (DeepSpeed's groups, megatron/topology.py), so its reduction cannot."""

    def __init__(self, cfg: ModelConfig, layer_number: int, num_experts: int, *, tp: GroupInfo, ep: GroupInfo,
                 init_seed: int) -> None:
        super().__init__()
        self.expert_tp = cfg.moe.enable_expert_tensor_parallelism and tp.size > 1
        local = num_experts // ep.size
        first = ep.rank * local  # global id of this rank's first expert
        # With expert TP the capacity slots come split over TP (dim 0 of the expert's input): the MLP's sequence-
        # parallel mode gathers them into its column-parallel fc1 and reduce-scatters its row-parallel fc2's output.
        mlp_tp = tp if self.expert_tp else GroupInfo([0], 0, None)
        self.deepspeed_experts = nn.ModuleList(
            MLP(cfg, layer_number, tp=mlp_tp, sequence_parallel=self.expert_tp, init_seed=init_seed,
                init_prefix=f"layers.{layer_number}.mlp.experts.{first + i}") for i in range(local))
        if not self.expert_tp:
            mark_replicated(self)
        for p in self.parameters():
            p.allreduce = False
            p.group_name = expert_group_name(ep.size)
            if not self.expert_tp and tp.size > 1:
                p.register_hook(_summed_over(tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [ep, E_local, c, h] (the slots each EP rank sent to each local expert) -> the same shape."""
        outs = []
        for i, expert in enumerate(self.deepspeed_experts):
            y, bias = expert(x[:, i].transpose(0, 1))  # [c, ep, h]: the slots first, as the MLP's sequence dim
            outs.append((y if bias is None else y + bias).transpose(0, 1))  # [ep, c, h]
        return torch.stack(outs, dim=1)


def _summed_over(tp: GroupInfo):
    """A tensor hook: the gradient summed over ``tp`` (it runs before autograd accumulates it into ``.grad``, so
    DeepSpeed's and ZeRO's accumulation hooks see the sum)."""
    return lambda grad: comm.all_reduce(grad.clone(), tp.group)


class RoutedExperts(nn.Module):
    """Upstream's ``deepspeed_moe`` (DeepSpeed's MOELayer): the gate and this rank's experts, and the routed pass."""

    def __init__(self, cfg: ModelConfig, layer_number: int, num_experts: int, *, tp: GroupInfo, ep: GroupInfo,
                 init_seed: int) -> None:
        super().__init__()
        self.moe, self.layer_number, self.num_experts = cfg.moe, layer_number, num_experts
        self.tp, self.ep = tp, ep
        self.gate = TopKGate(cfg.hidden_size, num_experts, seed=init_seed, key=f"layers.{layer_number}.mlp.gate")
        self.experts = Experts(cfg, layer_number, num_experts, tp=tp, ep=ep, init_seed=init_seed)

    def route(self, tokens: torch.Tensor, keys: torch.Tensor) -> gating.Routing:
        """tokens [S, h], keys [S] (the tokens' draw keys) -> the routes, DeepSpeed's gate with our draws."""
        m = self.moe
        logits = self.gate(tokens)  # [S, E] fp32
        factor = m.moe_train_capacity_factor if self.training else m.moe_eval_capacity_factor
        if m.topk == 1:
            rts = draws.rts_uniform(keys, self.layer_number) if m.use_rts else None
            return gating.top1(logits, factor, m.moe_min_capacity, m.moe_token_dropping, rts, self.ep)
        if m.topk == 2:
            noise = draws.gumbel(keys, self.layer_number, self.num_experts) if m.moe_top2_2nd_expert_sampling else None
            return gating.top2(logits, factor, m.moe_min_capacity, m.moe_token_dropping, noise, self.ep)
        return gating.topk(logits, m.topk, factor, m.moe_min_capacity, m.moe_token_dropping, self.ep)

    def forward(self, tokens: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [S, h] (the same on every TP rank), keys [S] -> (output [S, h], the load-balancing loss)."""
        routing = self.route(tokens, keys)
        num_experts, hidden = self.num_experts, tokens.shape[-1]
        # Every TP rank holds the same tokens and routes: each sends and computes 1/TP of the slots (upstream's
        # drop_tokens / gather_tokens), whole experts or TP-split. The buffer, not the capacity, is padded to split
        # evenly (upstream asserts it divides, or pads the no-drop capacity): the padding slots are read by nothing.
        split = self.tp.size > 1
        slots_per_expert = -(-routing.capacity // self.tp.size) * self.tp.size if split else routing.capacity
        slots = route_slots(routing, num_experts, slots_per_expert)  # [k, S]
        buf = dispatch(tokens, slots, num_experts, slots_per_expert)  # [E, C, h]
        if split:
            buf = split_capacity(buf, self.tp)  # [E, C/tp, h]
        buf = all_to_all(buf, self.ep)  # [E, c, h]: EP rank i's slots for this rank's experts in chunk i
        c = buf.shape[1]
        out = self.experts(buf.view(self.ep.size, num_experts // self.ep.size, c, hidden))  # [ep, E_local, c, h]
        out = all_to_all(out.reshape(num_experts, c, hidden), self.ep)  # [E, c, h]: back where the tokens live
        if split:
            out = gather_capacity(out, self.tp)  # [E, C, h]
        return combine(out, slots, routing.weights), routing.l_aux
