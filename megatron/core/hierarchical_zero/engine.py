"""Hierarchical ZeRO-3 for Frontier's three bandwidth tiers: a self-contained sharded data-parallel engine.

Three partitions of one flat parameter buffer (padded to a multiple of DP x block), per rank:

* primary: fp32 master weights, AdamW moments and the reduced fp32 gradient, 1/DP of the buffer;
* secondary: the 16-bit (fp32 in tests) weights of the ``weights`` tier, 1/(DP ranks in that tier's unit);
  after every optimizer step the updated primary shard is all-gathered over the tiers above it (once per step,
  int8 on the network if asked), so the per-micro-batch all-gather in forward stays on package/node links;
* full weights exist only from forward to the end of backward (whole model at once, not layer by layer).

Gradients: each micro-batch reduce-scatters over every level below the network (package, then node) into an
fp32 accumulator of 1/(DP ranks per node); the optimizer step reduce-scatters that once over the network, where
each rank sends 1/(ranks per node) of the gradient, i.e. the node as a whole sends it once.

The object quacks like the DeepSpeed engine that megatron/training/step.py drives (forward, backward(loss),
step() every micro-batch, get_lr, get_global_grad_norm, module, mpu). Selected by megatron/engine.py only.
"""

from __future__ import annotations

import logging

import torch

from megatron.core import comm
from megatron.core.hierarchical_zero.collectives import (
    all_gather_levels,
    quantized_all_gather,
    quantized_reduce_scatter,
    reduce_scatter_levels,
)
from megatron.core.hierarchical_zero.config import HierarchyConfig
from megatron.core.hierarchical_zero.groups import Hierarchy
from megatron.core.parallel_state import ParallelState

logger = logging.getLogger(__name__)


class HierarchicalZeroEngine:
    def __init__(self, model: torch.nn.Module, hcfg: HierarchyConfig, hierarchy: Hierarchy, pstate: ParallelState,
                 optimizer_factory, scheduler_factory, grad_accumulation_steps: int, clip_grad: float,
                 dtype: torch.dtype = torch.float32) -> None:
        """``optimizer_factory(param_groups)`` builds the optimizer over the fp32 master shards (decay, no-decay);
        ``scheduler_factory(optimizer)`` its LR schedule."""
        self.module, self.mpu, self.cfg, self.h = model, pstate, hcfg, hierarchy
        self.gas, self.clip_grad, self.dtype = grad_accumulation_steps, clip_grad, dtype
        self.skipped_steps, self.micro_steps, self.global_steps = 0, 0, 0
        self._norm: float | None = None

        # Megatron's weight-decay split (no decay on 1-D tensors), decay first, so each shard has <= 2 pieces.
        params = [p for p in model.parameters() if p.requires_grad]
        params = [p for p in params if p.dim() > 1] + [p for p in params if p.dim() <= 1]
        self.params = params
        self.shapes = [p.shape for p in params]
        self.n_decay = sum(p.numel() for p in params if p.dim() > 1)
        n = sum(p.numel() for p in params)
        unit = hierarchy.dp_size * hcfg.block
        self.numel, self.padded = n, -(-n // unit) * unit
        flat = torch.zeros(self.padded, dtype=torch.float32)  # [N_pad] initial weights, fp32
        torch.cat([p.detach().float().reshape(-1) for p in params], out=flat[:n])
        # Whether a param counts in the grad norm: TP-sharded on every TP rank, replicated ones on TP rank 0.
        counted = torch.zeros(self.padded, dtype=torch.bool)
        off = 0
        for p in params:
            counted[off:off + p.numel()] = pstate.tp.rank == 0 or getattr(p, "tensor_model_parallel", False)
            off += p.numel()

        self.intra = [lv for lv in hierarchy.levels if lv.name != "network"]  # per micro-batch levels
        self.net = [lv for lv in hierarchy.levels if lv.name == "network"]
        self.weight_levels = hierarchy.upto(hcfg.weights)  # gathered every forward
        self.refresh_levels = hierarchy.after(hcfg.weights)  # gathered after every optimizer step
        all_levels = hierarchy.levels
        self.primary_size = self.padded // hierarchy.shard_count(all_levels)
        start = hierarchy.shard_index(all_levels) * self.primary_size
        self.primary_range = (start, start + self.primary_size)
        self.counted = counted[start:start + self.primary_size]
        sec = self.padded // hierarchy.shard_count(self.weight_levels)
        s0 = hierarchy.shard_index(self.weight_levels) * sec
        self.secondary = flat[s0:s0 + sec].to(dtype)  # [N_pad / ranks sharing the weights]
        acc = self.padded // hierarchy.shard_count(self.intra)
        self.grad_acc = torch.zeros(acc, dtype=torch.float32)  # [N_pad / DP ranks per node]
        self.residual = torch.zeros(acc, dtype=torch.float32) if hcfg.int8 and self.net else None

        # fp32 master pieces: [start, n_decay) decays, the rest (incl. padding) does not.
        cut = min(max(self.n_decay, start), start + self.primary_size)
        self.pieces: list[tuple[int, int, torch.nn.Parameter]] = []
        groups = []
        for lo, hi, wd in ((start, cut, None), (cut, start + self.primary_size, 0.0)):
            if hi > lo:
                piece = torch.nn.Parameter(flat[lo:hi].clone())
                self.pieces.append((lo - start, hi - start, piece))
                groups.append({"params": [piece]} | ({} if wd is None else {"weight_decay": wd}))
        if dtype != torch.float32:
            model.to(dtype)  # after the fp32 master copy was taken from the fp32 initial weights
        self.optimizer = optimizer_factory(groups)
        self.lr_scheduler = scheduler_factory(self.optimizer)
        self._gathered = False
        self._release()
        logger.info("hierarchical ZeRO: levels %s, weights per %s, int8=%s; %d params, shard %d, weight copy %d",
                    [(lv.name, lv.size) for lv in hierarchy.levels], hcfg.weights, hcfg.int8, n,
                    self.primary_size, sec)

    # ------------------------------------------------------------------ weights
    def _gather(self) -> None:
        full = all_gather_levels(self.secondary, self.weight_levels)  # [N_pad], model dtype
        off = 0
        for p, shape in zip(self.params, self.shapes, strict=True):
            p.data = full[off:off + shape.numel()].view(shape)
            off += shape.numel()
        self._gathered = True

    def _release(self) -> None:
        for p in self.params:
            p.data = torch.empty(0, dtype=self.dtype)  # shapes are kept in self.shapes for the next gather
        self._gathered = False

    def _refresh_secondary(self) -> None:
        """Updated primary shard -> this rank's secondary shard (once per optimizer step)."""
        shard = torch.empty(self.primary_size, dtype=torch.float32)
        for lo, hi, piece in self.pieces:
            shard[lo:hi] = piece.detach()
        levels = self.refresh_levels
        if self.cfg.int8 and levels and levels[-1].name == "network":
            shard = quantized_all_gather(shard.to(self.dtype).float(), levels[-1], self.cfg.block)
            levels = levels[:-1]
        self.secondary = all_gather_levels(shard.to(self.dtype), levels)

    # ------------------------------------------------------------------ DeepSpeed-engine interface
    def __call__(self, *args, **kwargs):
        if not self._gathered:
            self._gather()
        return self.module(*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of loss / GAS, then the per-micro-batch (package, node) reduce-scatter into the accumulator."""
        (loss / self.gas).backward()
        grads = torch.zeros(self.padded, dtype=self.dtype)  # [N_pad]
        off = 0
        for p, shape in zip(self.params, self.shapes, strict=True):
            if p.grad is not None:
                grads[off:off + shape.numel()] = p.grad.reshape(-1)
            p.grad = None
            off += shape.numel()
        self.grad_acc += reduce_scatter_levels(grads, self.intra).float()
        self._release()

    def step(self) -> None:
        self.micro_steps += 1
        if self.micro_steps % self.gas:
            return
        if self.net and self.cfg.int8:
            grad = quantized_reduce_scatter(self.grad_acc, self.net[0], self.cfg.block, self.residual)
        elif self.net:
            grad = reduce_scatter_levels(self.grad_acc.to(self.dtype), self.net).float()
        else:  # one node: the per-micro-batch levels already reduced everything
            grad = self.grad_acc.clone()
        grad /= self.h.dp_size  # [N_pad / DP]: the mean over DP, as DeepSpeed averages
        self.grad_acc.zero_()
        self._norm = self._clip(grad)
        for lo, hi, piece in self.pieces:
            piece.grad = grad[lo:hi].clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        self._refresh_secondary()
        self.global_steps += 1

    def _clip(self, grad: torch.Tensor) -> float:
        """Global L2 norm over DP shards and TP ranks (each weight once); scales ``grad`` in place if too big."""
        sq = grad.double().pow(2).mul(self.counted).sum().reshape(1)
        if self.h.dp_size > 1:
            comm.all_reduce(sq, self.mpu.dp.group)
        if self.mpu.mp.size > 1:
            comm.all_reduce(sq, self.mpu.mp.group)
        norm = sq.sqrt().item()
        if self.clip_grad > 0:
            coef = self.clip_grad / (norm + 1e-6)
            if coef < 1.0:
                grad.mul_(coef)
        return norm

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self._norm

    def zero_optimization(self) -> bool:
        return True

    def fp16_enabled(self) -> bool:
        return False

    def bfloat16_enabled(self) -> bool:
        return self.dtype == torch.bfloat16

    def full_parameters(self) -> torch.Tensor:
        """The fp32 master weights of the whole model [N] (collective over DP; for tests and checkpoints)."""
        shard = torch.empty(self.primary_size, dtype=torch.float32)
        for lo, hi, piece in self.pieces:
            shard[lo:hi] = piece.detach()
        return all_gather_levels(shard, self.h.levels)[: self.numel]
