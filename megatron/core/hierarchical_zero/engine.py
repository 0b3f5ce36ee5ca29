"""Hierarchical ZeRO-3 for Frontier's three bandwidth tiers: a self-contained sharded data-parallel engine.

Parameters are grouped in buckets, one per top-level module (``nn.ModuleList`` entries count as modules: one bucket
per transformer layer). Each bucket is padded to a multiple of DP x block and has, per rank:

* primary: 1/DP of it as fp32 master weights with AdamW moments (all buckets' shards in one flat tensor);
* secondary: the 16-bit (fp32 in tests) weights of the ``weights`` tier, 1/(DP ranks in one unit of that tier);
  after every optimizer step the updated primary shards are all-gathered over the tiers above it (once per step,
  int8 on the network if asked), so the per-micro-batch all-gathers in forward and backward stay on package/node
  links;
* full weights only while the bucket's module runs: gathered by a forward pre-hook, freed after its forward,
  gathered again before its backward, freed when its last gradient has arrived. The first bucket (the embedding,
  whose weight the tied output layer also reads) stays gathered from forward to the end of backward.

Gradients: when a bucket's gradients are complete they are reduce-scattered over every level below the network
(package, then node) into an fp32 accumulator of 1/(DP ranks per node); the optimizer step reduce-scatters all
accumulators once over the network (one call), where each rank sends 1/(ranks per node) of the gradient.

The object quacks like the DeepSpeed engine that megatron/training/step.py drives (forward, backward(loss),
step() every micro-batch, get_lr, get_global_grad_norm, module, mpu). Selected by megatron/engine.py only.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

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


def bucket_modules(model: nn.Module) -> list[nn.Module]:
    """Top-level children in registration order, ``nn.ModuleList`` / ``nn.Sequential`` expanded one level."""
    out: list[nn.Module] = []
    for child in model.children():
        out.extend(child.children() if isinstance(child, (nn.ModuleList, nn.Sequential)) else [child])
    return out


def bucket_params(model: nn.Module) -> list[tuple[nn.Module | None, list[nn.Parameter]]]:
    """(module whose hooks gather it, parameters) per bucket; bucket 0 (module None) holds the root's own parameters
    and the first module's, and is gathered for the whole forward and backward."""
    seen: set[int] = set()

    def fresh(params) -> list[nn.Parameter]:
        ps = [p for p in params if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in ps)
        return ps

    modules = bucket_modules(model)
    out: list[tuple[nn.Module | None, list[nn.Parameter]]] = [
        (None, fresh(model.parameters(recurse=False)) + (fresh(modules[0].parameters()) if modules else []))]
    for mod in modules[1:]:
        ps = fresh(mod.parameters())
        if ps:
            out.append((mod, ps))
    return out


def padded_sizes(model: nn.Module, unit: int) -> list[int]:
    """Elements of each bucket padded to a multiple of ``unit`` (DP x int8 block)."""
    return [max(unit, -(-sum(p.numel() for p in ps) // unit) * unit) for _, ps in bucket_params(model)]


class _Bucket:
    """One module's parameters: where they sit in the padded flat layout, and this rank's pieces of them."""

    def __init__(self, params: list[nn.Parameter], offset: int, padded: int) -> None:
        self.params, self.shapes = params, [p.shape for p in params]
        self.offset, self.padded = offset, padded
        self.secondary = torch.empty(0)
        self.acc = torch.empty(0)
        self.gathered = False
        self.waiting: set[int] = set()
        self.reduced = True


def _regroup(x: torch.Tensor, k: int, sizes: list[int]) -> tuple[torch.Tensor, list[int]]:
    """After an all-gather over k ranks of concatenated per-bucket chunks: concatenate each bucket's k chunks."""
    parts = x.view(k, -1).split(sizes, dim=1)  # k rows, each [sum(sizes)] -> per bucket (k, size)
    return torch.cat([p.reshape(-1) for p in parts]), [k * s for s in sizes]


class HierarchicalZeroEngine:
    def __init__(self, model: nn.Module, hcfg: HierarchyConfig, hierarchy: Hierarchy, pstate: ParallelState,
                 optimizer_factory, scheduler_factory, grad_accumulation_steps: int, clip_grad: float,
                 dtype: torch.dtype = torch.float32) -> None:
        """``optimizer_factory(param_groups)`` builds the optimizer over the fp32 master shard (its default weight
        decay is applied here, masked to Megatron's split); ``scheduler_factory(optimizer)`` its LR schedule."""
        self.module, self.mpu, self.cfg, self.h = model, pstate, hcfg, hierarchy
        self.gas, self.clip_grad, self.dtype = grad_accumulation_steps, clip_grad, dtype
        self.skipped_steps, self.micro_steps, self.global_steps = 0, 0, 0
        self.micro_batch_size = 1  # create_engine sets --micro-batch-size: train_batch_size() is the LR increment
        self._norm: torch.Tensor | None = None
        # Every buffer lives where the model does (the accelerator on a GPU run): NCCL/RCCL collectives need
        # device tensors, and the gathered weights feed the module directly.
        self.device = next(model.parameters()).device
        dev = self.device
        self.intra = [lv for lv in hierarchy.levels if lv.name != "network"]  # per micro-batch levels
        self.net = [lv for lv in hierarchy.levels if lv.name == "network"]
        self.weight_levels = hierarchy.upto(hcfg.weights)  # gathered around every module call
        self.refresh_levels = hierarchy.after(hcfg.weights)  # gathered after every optimizer step

        buckets = bucket_params(model)
        self.buckets: list[_Bucket] = []
        offset = 0
        for (_, ps), padded in zip(buckets, padded_sizes(model, hierarchy.dp_size * hcfg.block), strict=True):
            self.buckets.append(_Bucket(ps, offset, padded))
            offset += padded
        self.padded = offset
        flat = torch.zeros(offset, dtype=torch.float32, device=dev)  # [N_pad] initial weights, fp32
        decay = torch.zeros(offset, dtype=torch.bool, device=dev)  # Megatron's split: no weight decay on 1-D tensors
        counted = torch.zeros(offset, dtype=torch.bool, device=dev)  # TP-sharded on every TP rank, replicated on TP 0
        for b in self.buckets:
            off = b.offset
            for p in b.params:
                flat[off:off + p.numel()] = p.detach().float().reshape(-1)
                decay[off:off + p.numel()] = p.dim() > 1
                counted[off:off + p.numel()] = pstate.tp.rank == 0 or getattr(p, "tensor_model_parallel", False)
                off += p.numel()

        def pieces(levels) -> list[tuple[_Bucket, int, int]]:
            """(bucket, start, length) of this rank's chunk of every bucket after reduce-scattering ``levels``."""
            count, idx = hierarchy.shard_count(levels), hierarchy.shard_index(levels)
            return [(b, b.offset + idx * (b.padded // count), b.padded // count) for b in self.buckets]

        gidx = torch.cat([torch.arange(s, s + n, device=dev) for _, s, n in pieces(hierarchy.levels)])  # -> flat
        self.primary_sizes = [n for _, _, n in pieces(hierarchy.levels)]
        self.decay_mask, self.counted = decay[gidx], counted[gidx]
        for b, s, n in pieces(self.weight_levels):
            b.secondary = flat[s:s + n].to(dtype)  # [bucket / ranks sharing the weights]
        for b, _, n in pieces(self.intra):
            b.acc = torch.zeros(n, dtype=torch.float32, device=dev)  # [bucket / DP ranks per node]
        acc_total = sum(b.acc.numel() for b in self.buckets)
        self.residual = torch.zeros(acc_total, device=dev) if hcfg.int8 and self.net else None
        self.master = nn.Parameter(flat[gidx].clone())  # [N_pad / DP] fp32
        if dtype != torch.float32:
            model.to(dtype)  # after the fp32 master copy was taken from the fp32 initial weights
        # The decay is applied here, masked to Megatron's split: the optimizer's own is off (wd_mult 0).
        self.optimizer = optimizer_factory([{"params": [self.master], "weight_decay": 0.0, "wd_mult": 0.0}])
        self.weight_decay = float(self.optimizer.defaults.get("weight_decay", 0.0))
        self.lr_scheduler = scheduler_factory(self.optimizer)
        for b in self.buckets:
            self._release(b)
        for b, (mod, _) in zip(self.buckets[1:], buckets[1:], strict=True):
            self._hook(b, mod)
        logger.info("hierarchical ZeRO: levels %s, weights per %s, int8=%s; %d buckets, %d padded params",
                    [(lv.name, lv.size) for lv in hierarchy.levels], hcfg.weights, hcfg.int8, len(self.buckets),
                    offset)

    # ------------------------------------------------------------------ weights
    def _hook(self, b: _Bucket, mod: nn.Module) -> None:
        mod.register_forward_pre_hook(lambda m, args: self._gather(b))
        mod.register_forward_hook(lambda m, args, out: self._release(b))
        mod.register_full_backward_pre_hook(lambda m, grad_out: self._gather(b))
        for p in b.params:
            p.register_post_accumulate_grad_hook(lambda p, b=b: self._grad_ready(b, p))

    def _gather(self, b: _Bucket) -> None:
        if b.gathered:
            return
        full = all_gather_levels(b.secondary, self.weight_levels)  # [bucket padded], model dtype
        off = 0
        for p, shape in zip(b.params, b.shapes, strict=True):
            p.data = full[off:off + shape.numel()].view(shape)
            off += shape.numel()
        b.gathered = True

    def _release(self, b: _Bucket) -> None:
        for p in b.params:
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)  # autograd's saved refs see re-gathers
        b.gathered = False

    def refresh_secondary(self) -> None:
        """Updated primary shards -> this rank's secondary shards (once per optimizer step, and after a load at
        another layout: checkpointing/relayout/)."""
        x, sizes = self.master.detach(), list(self.primary_sizes)
        levels = list(self.refresh_levels)
        if self.cfg.int8 and levels and levels[-1].name == "network":
            x = quantized_all_gather(x.to(self.dtype).float(), levels[-1], self.cfg.block)
            x, sizes = _regroup(x, levels[-1].size, sizes)
            levels = levels[:-1]
        x = x.to(self.dtype)
        for lv in reversed(levels):
            x, sizes = _regroup(comm.all_gather(x, lv.group), lv.size, sizes)
        for b, sec in zip(self.buckets, x.split(sizes), strict=True):
            b.secondary = sec.clone()

    # ------------------------------------------------------------------ gradients
    def _grad_ready(self, b: _Bucket, p: nn.Parameter) -> None:
        b.waiting.discard(id(p))
        if not b.waiting and not b.reduced:
            self._reduce(b)
            self._release(b)

    def _reduce(self, b: _Bucket) -> None:
        grads = torch.zeros(b.padded, dtype=self.dtype, device=self.device)  # [bucket padded]
        off = 0
        for p, shape in zip(b.params, b.shapes, strict=True):
            if p.grad is not None:
                grads[off:off + shape.numel()] = p.grad.reshape(-1)
            p.grad = None
            off += shape.numel()
        b.acc += reduce_scatter_levels(grads, self.intra).float()
        b.reduced = True

    # ------------------------------------------------------------------ DeepSpeed-engine interface
    def __call__(self, *args, **kwargs):
        self._gather(self.buckets[0])
        return self.module(*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of loss / GAS; buckets reduce as their gradients complete, bucket 0 (tied) at the end."""
        for b in self.buckets:
            b.waiting, b.reduced = {id(p) for p in b.params}, False
        (loss / self.gas).backward()
        for b in self.buckets:
            if not b.reduced:  # bucket 0, and modules this micro-batch did not use
                self._reduce(b)
                self._release(b)

    def train_batch_size(self) -> int:
        return self.gas * self.micro_batch_size * self.h.dp_size

    def gradient_accumulation_steps(self) -> int:
        return self.gas

    def step(self, lr_kwargs: dict | None = None) -> None:
        """``lr_kwargs``: as DeepSpeed's, passed to the LR schedule (default: this step's global batch)."""
        self.micro_steps += 1
        if self.micro_steps % self.gas:
            return
        if self.net:
            k = self.net[0].size
            # Rows = network ranks: row i holds every bucket's chunk i, i.e. rank i's primary layout.
            acc = torch.cat([b.acc.view(k, -1) for b in self.buckets], dim=1).reshape(-1)  # [N_pad / A]
            if self.cfg.int8:
                grad = quantized_reduce_scatter(acc, self.net[0], self.cfg.block, self.residual)
            else:
                grad = reduce_scatter_levels(acc.to(self.dtype), self.net).float()
        else:  # one node: the per-micro-batch levels already reduced everything
            grad = torch.cat([b.acc for b in self.buckets])
        grad /= self.h.dp_size  # [N_pad / DP]: the mean over DP, as DeepSpeed averages
        for b in self.buckets:
            b.acc.zero_()
        self._norm = self._clip(grad)
        lr = self.optimizer.param_groups[0]["lr"]
        # The schedule's decay for this step (--weight-decay-incr-style), else the optimizer's constant one.
        wd = getattr(self.lr_scheduler, "current_wd", None)
        wd = self.weight_decay if wd is None else wd
        with torch.no_grad():  # AdamW's decoupled decay, masked to Megatron's split (applied first, as torch does)
            factor = torch.ones_like(self.master).masked_fill_(self.decay_mask, 1 - lr * wd)
            self.master.mul_(factor)
        self.master.grad = grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step(**(lr_kwargs or {"increment": self.train_batch_size()}))
        self.refresh_secondary()
        self.global_steps += 1

    def _clip(self, grad: torch.Tensor) -> torch.Tensor:
        """Global L2 norm over DP shards and TP ranks (each weight once); scales ``grad`` in place if too big.
        All on the device: the norm [1] (float64) stays there until the log reads it."""
        sq = grad.double().pow(2).mul(self.counted).sum().reshape(1)
        if self.h.dp_size > 1:
            sq = comm.all_reduce(sq.to(comm.collective_device(self.mpu.dp.group)), self.mpu.dp.group)
        if self.mpu.mp.size > 1:
            sq = comm.all_reduce(sq.to(comm.collective_device(self.mpu.mp.group)), self.mpu.mp.group)
        norm = sq.sqrt().to(grad.device)
        if self.clip_grad > 0:
            # x1.0 (exact) when within clip_grad; the factor rounds to fp32 as a Python float did before.
            grad.mul_((self.clip_grad / (norm + 1e-6)).clamp(max=1.0).to(grad.dtype).reshape(()))
        return norm

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> torch.Tensor | None:
        return self._norm

    def zero_optimization(self) -> bool:
        return True

    def fp16_enabled(self) -> bool:
        return False

    def bfloat16_enabled(self) -> bool:
        return self.dtype == torch.bfloat16
