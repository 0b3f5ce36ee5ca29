"""What a job-script case asks for, worked out from its flags (and DeepSpeed JSON) alone with upstream
Megatron-DeepSpeed's rules, never with megatron/: the iterations and batch sizes it trains, its parallel layout and
the model features; and the start-up lines of a run that report them (megatron/training/layout_report.py)."""

from __future__ import annotations

import json
import re

_LAYOUT = re.compile(r"^> layout: world (\d+) = TP (\d+) x PP (\d+)(?: x SP (\d+) \(DeepSpeed-Ulysses\))? x DP (\d+); "
                     r"ZeRO-(\d); (\w+); sequence parallel (True|False); recompute (\w+)", re.M)
_FEATURES = re.compile(r"^> model features: (.*)$", re.M)
_BATCH = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?\| global batch size:\s+(\d+) ")


def options(flags: list[str]) -> dict[str, list[str]]:
    """flag -> the words after it (--a=b as --a b); a repeated flag keeps its last values, as argparse does."""
    opts: dict[str, list[str]] = {}
    current = None
    for word in flags:
        if word.startswith("--"):
            current, _, value = word.partition("=")
            opts[current] = [value] if value else []
        elif current is not None:
            opts[current].append(word)
    return opts


def _int(opts: dict, flag: str, default: int | None = None) -> int | None:
    return int(opts[flag][0]) if flag in opts else default


def _ds_json(path: str | None) -> dict:
    if not path:
        return {}
    with open(path) as f:
        return json.load(f)


def layout(opts: dict, world: int, ds_json: str | None) -> dict:
    tp, pp = _int(opts, "--tensor-model-parallel-size", 1), _int(opts, "--pipeline-model-parallel-size", 1)
    sp = _int(opts, "--ds-sequence-parallel-size", 1)
    js = _ds_json(ds_json)
    json_stage = (js.get("zero_optimization") or {}).get("stage")
    flag_stage = _int(opts, "--zero-stage")
    # DeepSpeed takes the stage from the JSON; the scripts pass the same number as --zero-stage.
    assert None in (json_stage, flag_stage) or json_stage == flag_stage, "the case's JSON and flags disagree"
    zero = json_stage if json_stage is not None else (flag_stage or 0)
    if "--bf16" in opts or (js.get("bf16") or {}).get("enabled"):
        dtype = "bf16"
    elif "--fp16" in opts or (js.get("fp16") or {}).get("enabled"):
        dtype = "fp16"
    else:
        dtype = "fp32"
    granularity = (opts.get("--recompute-granularity") or [None])[0]
    # upstream's --checkpoint-activations is full recompute; --recompute-activations is selective
    recompute = "full" if "--checkpoint-activations" in opts else "selective" if "--recompute-activations" in opts \
        else granularity or "none"
    return dict(world=world, tp=tp, pp=pp, sp=sp, dp=world // (tp * pp * sp), zero=zero, dtype=dtype,
                sequence_parallel="--sequence-parallel" in opts, recompute=recompute)


def reported_layout(stdout: str) -> dict | None:
    m = _LAYOUT.search(stdout)
    if m is None:
        return None
    world, tp, pp, sp, dp, zero, dtype, seq_par, recompute = m.groups()
    return dict(world=int(world), tp=int(tp), pp=int(pp), sp=int(sp or 1), dp=int(dp), zero=int(zero), dtype=dtype,
                sequence_parallel=seq_par == "True", recompute=recompute)


def batch_sizes(opts: dict, world: int) -> list[int]:
    """The global batch size of every iteration the run trains: upstream's update_train_iters (iterations from
    --train-samples, a --rampup-batch-size phase counted batch by batch), its loop's --train-tokens stop and
    --exit-interval, and the ramp's batch size per consumed samples (RampupBatchsizeNumMicroBatches)."""
    lay = layout(opts, world, None)
    mbs = _int(opts, "--micro-batch-size")
    gbs = _int(opts, "--global-batch-size", mbs * lay["dp"])
    ramp = [int(v) for v in opts["--rampup-batch-size"]] if "--rampup-batch-size" in opts else None

    def batch(consumed: int) -> int:
        if ramp is None:
            return gbs
        start, increment, ramp_samples = ramp
        if consumed > ramp_samples:
            return gbs
        per_increment = ramp_samples / ((gbs - start) // increment)
        return start + int(consumed / per_increment) * increment

    if "--train-iters" in opts:
        iters = _int(opts, "--train-iters")
    elif ramp is None:
        iters = _int(opts, "--train-samples") // gbs
    else:
        iters, consumed = 0, 0
        while consumed <= ramp[2]:
            consumed += batch(consumed)
            iters += 1
        iters += (_int(opts, "--train-samples") - consumed) // gbs  # the partial last batch is dropped
    if "--exit-interval" in opts:
        iters = min(iters, _int(opts, "--exit-interval"))
    tokens = _int(opts, "--train-tokens")
    sizes, consumed = [], 0
    while len(sizes) < iters and (tokens is None or consumed * _int(opts, "--seq-length") < tokens):
        sizes.append(batch(consumed))
        consumed += sizes[-1]
    return sizes


def logged_batch_sizes(stdout: str) -> dict[int, int]:
    return {int(m.group(1)): int(m.group(2)) for m in _BATCH.finditer(stdout)}


def features(opts: dict) -> str:
    """The model-features line rank 0 prints (the first pipeline stage's view when PP > 1)."""
    heads = _int(opts, "--num-attention-heads")
    kv_heads = _int(opts, "--num-key-value-heads", heads)
    parts = [(opts.get("--normalization") or ["layernorm"])[0], "swiglu MLP" if "--swiglu" in opts else "gelu MLP"]
    rope = "--use-rotary-position-embeddings" in opts or (opts.get("--position-embedding-type") or [""])[0] == "rope"
    if rope:
        head_dim = _int(opts, "--kv-channels", _int(opts, "--hidden-size") // heads)
        percent = float((opts.get("--rotary-percent") or ["1.0"])[0])
        parts.append(f"rotary positions ({int(head_dim * percent)} of {head_dim} dims per head)")
    parts.append(f"{heads} query heads over {kv_heads} KV heads (GQA)" if kv_heads < heads else f"{heads} heads (MHA)")
    if not rope:
        parts.append("learned positions")
    untied = "--untie-embeddings-and-output-weights" in opts
    if untied and _int(opts, "--pipeline-model-parallel-size", 1) > 1:
        parts.append("output layer on another stage")  # rank 0 holds the first stage
    else:
        parts.append("untied output layer" if untied else "tied output layer")
    parts.append("no linear biases" if "--disable-bias-linear" in opts else "linear biases")
    moe = _moe_features(opts)
    return ", ".join(parts + ([moe] if moe else []))


def _moe_features(opts: dict) -> str | None:
    """The MoE part of the features line, by upstream's get_num_experts_per_layer: layer n (1-based) has experts
    when n is a multiple of --expert-interval (default 2), one count for all or one per such layer. The cases with
    experts run at PP=1, where rank 0 holds every layer."""
    counts = [int(v) for v in opts.get("--num-experts", ["1"])]
    layers, interval = _int(opts, "--num-layers"), _int(opts, "--expert-interval", 2)
    counts = counts * (layers // interval) if len(counts) == 1 else counts
    per_layer = [counts[(n - 1) // interval] if n % interval == 0 else 1 for n in range(1, layers + 1)]
    moe = [n for n in per_layer if n > 1]
    if not moe:
        return None
    assert _int(opts, "--pipeline-model-parallel-size", 1) == 1, "work out rank 0's stage first"
    ep = _int(opts, "--moe-expert-parallel-size", 1)
    residual = ", PR-MoE" if (opts.get("--mlp-type") or ["standard"])[0] == "residual" else ""
    return (f"{len(moe)} MoE layers ({'/'.join(str(n) for n in sorted(set(moe)))} experts, {moe[0] // ep} on this "
            f"rank of EP {ep}, top-{_int(opts, '--topk', 1)}{residual})")


def reported_features(stdout: str) -> str | None:
    m = _FEATURES.search(stdout)
    return m.group(1) if m else None
