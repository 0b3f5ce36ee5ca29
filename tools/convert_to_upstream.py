"""Write one of this project's checkpoints (a ``--save`` directory or one of its tags, any TP/PP/ZeRO/EP layout, or
a full-state directory) in upstream Megatron-DeepSpeed's layout without its pipeline (``global_stepN/``:
``mp_rank_XX_model_states.pt`` per TP rank and, with experts, DeepSpeed's per-expert files), so upstream resumes it.

Carried: weights, iteration, consumed samples, the LR schedule's state and (fp32 ZeRO-1/2 checkpoints) the Adam
moments as DeepSpeed's ZeRO files for upstream's DP/EP; not RNG states: run upstream with the same flags plus
``--no-load-rng`` (``--no-load-optim`` too when the moments were not written). See docs/checkpoints.md.

    python tools/convert_to_upstream.py --load CHECKPOINTS --save UPSTREAM_DIR [--tp 1] [--dp N] [--ep E]
        [--no-optimizer]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.errors import ConfigError, run_cli  # noqa: E402


def main(argv=None) -> int:
    from megatron.checkpointing.hf.convert import read_any, read_moments
    from megatron.checkpointing.full_state.files import is_full_state
    from megatron.checkpointing.live.markers import read_latest, read_meta
    from megatron.checkpointing.upstream.writer import write_upstream

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="our --save directory, one of its tags, or a full state")
    p.add_argument("--tag", default=None, help="default: the one 'latest' names")
    p.add_argument("--save", required=True, help="output directory (upstream's --load)")
    p.add_argument("--tp", type=int, default=1, help="upstream's --tensor-model-parallel-size")
    p.add_argument("--dp", type=int, default=None, help="upstream's data-parallel size (default: the checkpoint's)")
    p.add_argument("--ep", type=int, default=None,
                   help="upstream's --moe-expert-parallel-size (default: the checkpoint's)")
    p.add_argument("--no-optimizer", action="store_true", help="weights and progress only (upstream: --no-load-optim)")
    args = p.parse_args(argv)
    full, model, progress = read_any(args.load, args.tag)
    flags, parallel, run = {}, {}, {}
    if not is_full_state(args.load):
        tag = args.tag or (None if os.path.isfile(os.path.join(args.load, "megatron_meta.json"))
                           else read_latest(args.load))
        meta = read_meta(os.path.join(args.load, tag) if tag else args.load)
        flags, parallel, run = meta.get("args") or {}, meta["run"]["parallel"], meta["run"]
    world = parallel.get("world_size", 1)
    dp = args.dp or max(1, world // (parallel.get("tensor_model_parallel_size", 1)
                                     * parallel.get("pipeline_model_parallel_size", 1)))
    ep = args.ep or parallel.get("moe_expert_parallel_size", 1)
    fields = dict(model)
    fields["ffn_hidden_size"] = fields.get("ffn_hidden_size") or 4 * fields["hidden_size"]
    fields["num_key_value_heads"] = fields.get("num_key_value_heads") or fields["num_attention_heads"]
    moe = dict(fields.get("moe") or {})
    moe["num_experts"] = list(moe.get("num_experts") or [1])
    if moe.get("mlp_type", "standard") != "standard":
        raise ConfigError("--mlp-type residual (PR-MoE): writing its residual MLP in upstream's names is not built")
    fields["moe"] = moe
    vocab, divisible = int(fields["vocab_size"]), int(fields.get("make_vocab_size_divisible_by", 128)) * args.tp
    padded = -(-vocab // divisible) * divisible
    run_flags = {k: flags[k] for k in ("global_batch_size", "seq_length", "tokenizer_type", "vocab_file",
                                       "merge_file") if flags.get(k) is not None}
    run_flags.setdefault("seq_length", fields.get("seq_length"))
    run_flags["zero_stage"] = parallel.get("zero_stage", 1)
    moments, step_count, why = (None, 0, "--no-optimizer") if args.no_optimizer else read_moments(args.load, args.tag)
    hyper = None
    if moments is not None:
        why = _no_zero_files(run, progress)
        if why:
            moments = None
        else:
            opt, train = run["optimizer"], run["training"]
            hyper = {"betas": (opt["adam_beta1"], opt["adam_beta2"]), "eps": opt["adam_eps"],
                     "weight_decay": opt["weight_decay"], "clip_grad": opt["clip_grad"],
                     "zero_stage": parallel["zero_stage"],
                     "ds_config": {"train_batch_size": train["global_batch_size"],
                                   "train_micro_batch_size_per_gpu": train["micro_batch_size"],
                                   "gradient_clipping": opt["clip_grad"],
                                   "zero_optimization": {"stage": parallel["zero_stage"]}}}
    step = write_upstream(args.save, full, fields, progress, tp=args.tp, dp=dp, ep=ep, padded_vocab=padded,
                          run_flags=run_flags, moments=moments, optimizer_step=step_count, hyper=hyper)
    print(f"> wrote {step} (TP {args.tp}, DP {dp}, EP {ep}; vocabulary padded to {padded} rows)")
    if moments is not None:
        print(f"> Adam moments (step {step_count}) written as ZeRO-{parallel['zero_stage']} files: run upstream with "
              f"the same flags, --load {args.save} --no-load-rng")
    else:
        print(f"> Adam moments not written ({why}): run upstream with --load {args.save} --no-load-optim "
              "--no-load-rng (its Adam restarts)")
    return 0


def _no_zero_files(run: dict, progress: dict) -> str:
    """Why DeepSpeed ZeRO-1/2 files cannot be written for this checkpoint ('' when they can)."""
    if not run:
        return "a full state keeps no optimizer settings: convert the training checkpoint itself"
    if run["precision"].get("fp16") or run["precision"].get("bf16"):
        return "fp16/bf16 optimizer files of DeepSpeed are not written, only fp32 ZeRO-1/2"
    if run["parallel"]["zero_stage"] not in (1, 2):
        return f"ZeRO-{run['parallel']['zero_stage']}: only ZeRO-1/2 files are written"
    if not progress.get("lr_scheduler"):
        return "the checkpoint keeps no LR scheduler state"
    return ""


if __name__ == "__main__":
    sys.exit(run_cli(main))
