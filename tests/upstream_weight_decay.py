"""Upstream Megatron-DeepSpeed's weight-decay split, restated for tests (tests/reference.py and
tests/unit/test_weight_decay_groups.py), so ours (megatron.optim.optimizer.param_groups) is checked against it.

Upstream (deepspeedai/Megatron-DeepSpeed megatron/optimizer/__init__.py, get_param_groups @ dd16deb): pretrain_gpt.py
passes no ``no_weight_decay_cond``, so a parameter escapes decay when its name ends with ".bias" or it is 1-D (norm
weights); everything else (embeddings, position table, every projection matrix) is decayed, with ``wd_mult`` 0 / 1.
"""

from __future__ import annotations

import torch


def upstream_no_decay(name: str, param: torch.Tensor) -> bool:
    return name.endswith(".bias") or param.dim() == 1


def upstream_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups as upstream's: decayed (``wd_mult`` 1) and not (``wd_mult`` 0); empty ones left out."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if upstream_no_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]
    return [g for g in groups if g["params"]]
