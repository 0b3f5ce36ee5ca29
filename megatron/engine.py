"""The one seam to DeepSpeed: build and check the ds_config from the validated RunConfig, then call
``deepspeed.initialize``. Nothing else in the project imports ``deepspeed`` for training.

The CLI is the single source of truth. A user's ``--deepspeed_config`` may add DeepSpeed knobs, but a
batch size, clipping, precision or ZeRO stage that disagrees with the flags is refused with a message
naming both values, never silently resolved.
"""

from __future__ import annotations

import copy
import json
import os

import deepspeed
import torch

from megatron.config import RunConfig
from megatron.core.parallel_state import ParallelState
from megatron.errors import ConfigError
from megatron.training.lr_schedule import OptimizerParamScheduler

TEMPLATE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deepspeed_configs")


def template_path(zero_stage: int, precision: str) -> str:
    return os.path.join(TEMPLATE_DIR, f"zero{zero_stage}_{precision}.json")


def load_ds_config(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"--deepspeed_config {path}: file not found; pass an existing JSON file or omit the flag "
                          "to use the template for --zero-stage")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed_config {path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})")
    if not isinstance(cfg, dict):
        raise ConfigError(f"--deepspeed_config {path}: the top level must be a JSON object")
    return cfg


def _agree(cfg: dict, key: str, want, flag: str, source: str) -> None:
    have = cfg.get(key)
    if isinstance(have, str) and have.startswith("filled from"):
        have = None
    if have is not None and have != want:
        raise ConfigError(f"{source} sets {key}={have} but {flag} gives {want}: make them agree or drop "
                          f"{key} from the JSON (it is filled from the flags)")
    cfg[key] = want


def build_ds_config(run: RunConfig, user_config: str | None = None, zero_stage_given: bool = True) -> dict:
    """The complete ds_config for this run. ``zero_stage_given``: --zero-stage was on the command line
    (otherwise a user JSON's stage wins and is written back into ``run``)."""
    p, t, o, prec = run.parallel, run.training, run.optimizer, run.precision
    source = f"--deepspeed_config {user_config}" if user_config else "template"
    if user_config:
        cfg = load_ds_config(user_config)
        if not zero_stage_given and "stage" in cfg.get("zero_optimization", {}):
            p.zero_stage = int(cfg["zero_optimization"]["stage"])
    else:
        cfg = load_ds_config(template_path(p.zero_stage, prec.name))
    cfg = copy.deepcopy(cfg)
    for section in ("optimizer", "scheduler"):
        if section in cfg:
            raise ConfigError(f"{source} has an '{section}' section: remove it; the optimizer and LR schedule "
                              "come from --lr, --min-lr, --lr-decay-style, --weight-decay, --adam-* flags")

    gas = t.grad_accumulation_steps(p.dp)
    _agree(cfg, "train_micro_batch_size_per_gpu", t.micro_batch_size, "--micro-batch-size", source)
    _agree(cfg, "train_batch_size", t.global_batch_size, "--global-batch-size", source)
    _agree(cfg, "gradient_accumulation_steps", gas, "--global-batch-size/(--micro-batch-size x DP)", source)
    _agree(cfg, "gradient_clipping", float(o.clip_grad), "--clip-grad", source)

    zero = cfg.setdefault("zero_optimization", {})
    if zero.get("stage", p.zero_stage) != p.zero_stage:
        raise ConfigError(f"{source} sets zero_optimization.stage={zero['stage']} but --zero-stage gives "
                          f"{p.zero_stage}: make them agree or drop one")
    zero["stage"] = p.zero_stage

    for name in ("fp16", "bf16"):
        enabled_in_json = bool(cfg.get(name, {}).get("enabled", False))
        wanted = getattr(prec, name)
        if user_config and name in cfg and enabled_in_json != wanted:
            raise ConfigError(f"{source} has {name}.enabled={str(enabled_in_json).lower()} but --{name} is "
                              f"{'set' if wanted else 'not set'}: make them agree")
        if wanted:
            cfg.setdefault(name, {})["enabled"] = True
        else:
            cfg.pop(name, None)
    if prec.fp16:
        # Dynamic loss scale (loss_scale 0) from the Megatron flags.
        cfg["fp16"].update(loss_scale=0, initial_scale_power=int(round(torch.log2(
            torch.tensor(prec.initial_loss_scale)).item())), loss_scale_window=prec.loss_scale_window,
            hysteresis=prec.hysteresis, min_loss_scale=prec.min_loss_scale)
    cfg["zero_allow_untested_optimizer"] = True  # our AdamW is torch's own
    cfg.setdefault("steps_per_print", 10**9)
    return cfg


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Megatron's split: no weight decay on biases and norm weights (any 1-D parameter)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.dim() == 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def initialize_engine(model: torch.nn.Module, run: RunConfig, pstate: ParallelState, ds_config: dict):
    """Wrap ``model`` in a DeepSpeed engine with AdamW and Megatron's LR schedule."""
    o = run.optimizer
    optimizer = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                  eps=o.adam_eps)
    scheduler = OptimizerParamScheduler(optimizer, o, run.training.train_iters)
    if run.parallel.zero_stage == 3 and getattr(model, "cfg", None) is not None and model.cfg.tie_embeddings:
        # The output layer reads the embedding's weight from outside that module: tell ZeRO-3 to gather it.
        deepspeed.zero.register_external_parameter(model, model.embedding.word_embeddings.weight)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, mpu=pstate,
                                           config=ds_config)
    return engine
