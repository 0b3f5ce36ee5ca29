"""Read a DeepSpeed JSON, apply the key table to it, and the sections the flags interact with.

Each function returns log lines ("notes") that rank 0 prints once before the process group; a refusal is
a ConfigError naming the key and what to use instead.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os

from megatron.compat.ds_config_keys import NOOP, REFUSED, classify, lookup
from megatron.config import OptimizerConfig, PrecisionConfig
from megatron.errors import ConfigError

NOTE = "> DeepSpeed JSON:"

# DeepSpeed's activation_checkpointing keys, the ModelConfig field each turns on, and the flag that sets it.
ACTIVATION_CHECKPOINTING = (("partition_activations", "recompute_partition", "--partition-activations"),
                            ("cpu_checkpointing", "recompute_on_cpu", "--checkpoint-in-cpu"),
                            ("synchronize_checkpoint_boundary", "recompute_synchronize", "--synchronize-each-layer"),
                            ("profile", "recompute_profile", "--profile-backward"))


def load_ds_config(path: str) -> dict:
    """The JSON object in ``path`` (a user's --deepspeed_config or one of our templates)."""
    if not os.path.isfile(path):
        raise ConfigError(f"--deepspeed_config {path}: file not found; pass an existing JSON file or omit the flag "
                          "to use the template for --zero-stage")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--deepspeed_config {path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"--deepspeed_config {path}: the top level must be a JSON object")
    return cfg


def apply_table(cfg: dict, source: str) -> list[str]:
    """Refuse refused/unknown keys, drop off-valued refused keys, and note the accepted no-ops."""
    notes = []
    for v in classify(cfg):
        if v.cls == REFUSED:
            raise ConfigError(f"{source}: {v.key}: {v.why}")
        if v.drop:
            _drop(cfg, v.key)
        if v.cls == NOOP and v.key.split(".")[0] not in ("optimizer", "scheduler"):  # those two: optimizer_note
            if (v.drop or not _unset(cfg, v.key)) and ("." not in v.key or not _noop_parent(v.key, cfg)):
                notes.append(f"{NOTE} {v.key} accepted, no effect here: {v.why}")
    if "bfloat16" in cfg:  # DeepSpeed's old spelling; it reads it only when "bf16" is absent
        if "bf16" in cfg:
            raise ConfigError(f"{source} has both 'bf16' and its old spelling 'bfloat16': keep 'bf16'")
        cfg["bf16"] = cfg.pop("bfloat16")
    return notes


def _noop_parent(key: str, cfg: dict) -> bool:
    """A no-op key under a no-op section is said with its section, not again."""

    parent = key.rsplit(".", 1)[0]
    hit = lookup(parent)
    return hit is not None and hit[0] == NOOP


def _unset(cfg: dict, key: str) -> bool:
    """null/false/0: a no-op key left at nothing needs no word in the log."""
    value = cfg
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value in (None, False, 0)


def _drop(cfg: dict, key: str) -> None:
    *path, last = key.split(".")
    d = cfg
    for part in path:
        d = d[part]
    d.pop(last, None)


def _pow2(flag: str, value: float) -> int:
    power = math.log2(value) if value > 0 else float("nan")
    if power != round(power):
        raise ConfigError(f"{flag} {value:g} is not a power of 2: DeepSpeed takes it as initial_scale_power; "
                          f"use e.g. {flag} {2.0 ** round(math.log2(max(value, 1))):g}")
    return int(power)


# DeepSpeed fp16 key, flag, how the flag's value becomes the key's value
_FP16_FLAGS = (("loss_scale", "--loss-scale", "loss_scale", float),
               ("initial_scale_power", "--initial-loss-scale", "initial_loss_scale", None),
               ("loss_scale_window", "--loss-scale-window", "loss_scale_window", int),
               ("hysteresis", "--hysteresis", "hysteresis", int),
               ("min_loss_scale", "--min-loss-scale", "min_loss_scale", float))


def fp16_loss_scale(cfg: dict, prec: PrecisionConfig, source: str, user_json: bool) -> list[str]:
    """Under --fp16 a user JSON's loss-scale keys are kept (the JSON wins, as upstream, where DeepSpeed scales the
    loss from the JSON); a given flag fills a key the JSON leaves out, and one that contradicts it is a warning.
    Keys in neither keep DeepSpeed's defaults, as upstream. Our own template yields to a given flag."""
    given = {key: (flag, getattr(prec, attr), conv) for key, flag, attr, conv in _FP16_FLAGS
             if getattr(prec, attr) is not None}
    if not prec.fp16:
        return [f"> {flag} {value:g} has no effect without --fp16 ({prec.name} needs no loss scaling)"
                for flag, value, _ in given.values()]
    section, notes = cfg["fp16"], []
    for key, (flag, value, conv) in given.items():
        want = _pow2(flag, value) if conv is None else conv(value)
        if user_json and key in section:
            if float(section[key]) != float(want):
                notes.append(f"WARNING: {flag} {value:g} contradicts fp16.{key}={section[key]} in {source}: the JSON "
                             "wins, as upstream (drop one of them to silence this)")
            continue
        section[key] = want
    return notes


def check_loss_scale_values(cfg: dict, source: str) -> None:
    section = cfg.get("fp16") or {}
    for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
        value = section.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"{source}: fp16.{key}={value!r} must be a number >= 0")


def _wd(o: OptimizerConfig) -> float | str:
    """The run's weight decay: a number, or its ramp (--weight-decay-incr-style)."""
    if o.weight_decay_incr_style == "constant":
        return o.weight_decay
    return f"{o.weight_decay_incr_style} {o.start_weight_decay:g} -> {o.end_weight_decay:g}"


def _wd_text(o: OptimizerConfig) -> str:
    wd = _wd(o)
    return wd if isinstance(wd, str) else f"{wd:g}"


def run_optimizer(o: OptimizerConfig, offload: bool) -> str:
    """What this run's optimizer is, in the words the JSON would use."""
    if o.cpu_optimizer or offload:
        kind = "torch AdamW" if o.cpu_torch_adam else "DeepSpeedCPUAdam (AdamW mode)"
        return f"{kind} lr={o.lr:g} betas=({o.adam_beta1:g}, {o.adam_beta2:g}) eps={o.adam_eps:g} " \
               f"weight_decay={_wd_text(o)}"
    if o.optimizer == "sgd":
        return f"SGD lr={o.lr:g} momentum={o.sgd_momentum:g} weight_decay={_wd_text(o)}"
    return f"AdamW lr={o.lr:g} betas=({o.adam_beta1:g}, {o.adam_beta2:g}) eps={o.adam_eps:g} " \
           f"weight_decay={_wd_text(o)}"


def _same(a, b) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return float(a) == float(b)
    return a == b


def _optimizer_differences(section: dict, o: OptimizerConfig) -> list[str]:
    kind = str(section.get("type", "")).lower()
    params = dict(section.get("params") or {})
    adam = o.optimizer == "adam"
    diffs = []
    if kind in ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"):
        if not adam:
            diffs.append(f"type={section['type']} (run: SGD)")
        w_mode = params.pop("adam_w_mode", True) if kind != "adamw" else True
        if adam and w_mode is not True:
            diffs.append(f"params.adam_w_mode={str(w_mode).lower()} (run: AdamW, decoupled weight decay)")
        expect = {"lr": o.lr, "betas": [o.adam_beta1, o.adam_beta2], "eps": o.adam_eps, "weight_decay": _wd(o),
                  "bias_correction": True, "amsgrad": False}
    elif kind == "sgd":
        if adam:
            diffs.append(f"type={section['type']} (run: AdamW)")
        expect = {"lr": o.lr, "momentum": o.sgd_momentum, "weight_decay": _wd(o), "nesterov": False,
                  "dampening": 0}
    else:
        diffs.append(f"type={section.get('type')!r} (run: {'AdamW' if adam else 'SGD'})")
        expect = {}
    for name, value in params.items():
        if name == "torch_adam":  # which kernel DeepSpeed would use for the same update: not a value of the run
            continue
        if name not in expect:
            diffs.append(f"params.{name}={value!r} (not used)")
        elif not _same(value, expect[name]):
            run_value = expect[name] if not isinstance(expect[name], list) else tuple(expect[name])
            diffs.append(f"params.{name}={value!r} (run: {run_value})")
    return diffs


def optimizer_note(cfg: dict, o: OptimizerConfig, offload: bool) -> list[str]:
    """The JSON 'optimizer' / 'scheduler' sections are not used, exactly as upstream (which passes its own
    optimizer and LR schedule to deepspeed.initialize); one line each names every value that differs."""
    notes = []
    if "optimizer" in cfg:
        section = cfg.pop("optimizer")
        diffs = _optimizer_differences(section if isinstance(section, dict) else {}, o) if section else []
        notes.append(f"{NOTE} 'optimizer' section not used (as upstream: the optimizer comes from the flags; this "
                     f"run: {run_optimizer(o, offload)}); "
                     + (f"it differs in: {', '.join(diffs)}" if diffs else "it agrees with the flags"))
    if "scheduler" in cfg:
        section = cfg.pop("scheduler") or {}
        values = [f"type={section.get('type')!r}"] + [f"params.{k}={v!r}" for k, v in
                                                        (section.get("params") or {}).items()]
        notes.append(f"{NOTE} 'scheduler' section not used (as upstream: the LR schedule comes from --lr, --min-lr, "
                     f"--lr-decay-style, --lr-warmup-*, --lr-decay-*); its values: {', '.join(values)}")
    return notes


def offload_device(cfg: dict) -> str:
    zero = cfg.get("zero_optimization") or {}
    device = str((zero.get("offload_optimizer") or {}).get("device", "none")).lower()
    if device == "none" and zero.get("cpu_offload"):  # DeepSpeed's deprecated spelling of the same
        device = "cpu"
    return device


def check_offload(cfg: dict, o: OptimizerConfig, zero_stage: int, accelerator_is_cpu: bool, source: str) -> None:
    """ZeRO-Offload and --cpu-optimizer: DeepSpeed's CPU Adam steps host copies of the parameters."""
    device = offload_device(cfg)
    param_device = str(((cfg.get("zero_optimization") or {}).get("offload_param") or {}).get("device", "none")).lower()
    if "nvme" in (device, param_device):
        raise ConfigError(f"{source}: offload device \"nvme\" (ZeRO-Infinity) is not built or tested here: use "
                          "\"cpu\" or \"none\"")
    if device == "cpu":
        if zero_stage == 0:
            raise ConfigError(f"{source}: zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3: set "
                              "--zero-stage (or zero_optimization.stage)")
        if o.optimizer != "adam":
            raise ConfigError(f"{source}: ZeRO-Offload runs Adam on the CPU, but --optimizer is {o.optimizer}: use "
                              "--optimizer adam or drop offload_optimizer")
    if (device == "cpu" or o.cpu_optimizer) and not o.cpu_torch_adam:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        if not CPUAdamBuilder().is_compatible(verbose=False):
            raise ConfigError(f"{'--cpu-optimizer' if o.cpu_optimizer else source + ': offload_optimizer'}: "
                              "DeepSpeed's CPU Adam cannot build here (no C++ compiler/ninja): add "
                              "--cpu-optimizer --cpu_torch_adam, or drop the offload")
    if o.cpu_optimizer and device != "cpu" and not accelerator_is_cpu:
        raise ConfigError("--cpu-optimizer needs zero_optimization.offload_optimizer.device \"cpu\" in the "
                          "DeepSpeed JSON (the CPU optimizer steps host copies of the parameters), as upstream")
    if device == "cpu" and o.cpu_torch_adam:
        cfg["zero_force_ds_cpu_optimizer"] = False  # DeepSpeed then takes torch's AdamW as the offloaded optimizer


def check_monitors(cfg: dict, source: str) -> None:
    for section, package in (("wandb", "wandb"), ("comet", "comet_ml")):
        if (cfg.get(section) or {}).get("enabled") and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{source}: {section}.enabled=true but the {package} package is not installed: "
                              f"pip install {package}, or set {section}.enabled false")
