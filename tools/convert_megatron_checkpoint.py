"""Convert a checkpoint written by upstream Megatron-DeepSpeed (``global_stepN/``: ZeRO-0/1/2, with or without its
pipeline layout, or DeepSpeed's universal form of one: ``global_stepN_universal/``) or by plain Megatron
(``iter_NNNNNNN/mp_rank_XX[_YYY]/model_optim_rng.pt``) into a full-state directory (model.safetensors +
full_state.json) that ``pretrain_gpt.py --load`` reads at any TP/PP/ZeRO layout.

Carried over: weights (vocabulary rows cut to the tokenizer's size), Adam moments where the files map them to
parameters (DeepSpeed ZeRO-1/2; ZeRO-0 without pipeline), iteration, consumed samples, LR position. Not carried:
RNG states (they belong to the writer's layout) and a plain Megatron optimizer (it keeps no parameter names).
The files are pickles with Python objects: only convert checkpoints you trust (--trust-checkpoint).

    python tools/convert_megatron_checkpoint.py --load CHECKPOINTS --save FULL_STATE_DIR --trust-checkpoint \
        [--iteration N] [--vocab-file VOCAB.json | --vocab-size V]
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.errors import CheckpointError, ConfigError, run_cli  # noqa: E402


def _vocab_file_size(path: str) -> int:
    try:
        with open(path) as f:
            return len(json.load(f))
    except (OSError, ValueError) as e:
        raise ConfigError(f"--vocab-file {path}: not a readable GPT-2 vocab.json ({e}); pass the one the run "
                          "trained with, or --vocab-size") from None


def _tokenizer_size(args: dict) -> int | None:
    """The GPT-2 BPE vocabulary's size from the vocab file upstream trained with, when that path still exists here
    (checkpoints record an absolute path, often on another machine or scratch area)."""
    path = args.get("vocab_file")
    if args.get("tokenizer_type") == "GPT2BPETokenizer" and path and os.path.isfile(path):
        return _vocab_file_size(path)
    return None


def main(argv=None) -> int:
    from megatron.checkpointing import upstream
    from megatron.checkpointing.hf.convert import write_full_state
    from megatron.model.param_names import VOCAB_PARAMS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="the directory upstream saved into (or one global_stepN/ iter_N/)")
    p.add_argument("--iteration", type=int, default=None,
                   help="default: the one 'latest' / latest_checkpointed_iteration.txt names")
    p.add_argument("--save", required=True, help="output full-state directory")
    vocab = p.add_mutually_exclusive_group()
    vocab.add_argument("--vocab-file", default=None,
                       help="the GPT-2 vocab.json the run trained with (default: the path the checkpoint recorded)")
    vocab.add_argument("--vocab-size", type=int, default=None,
                       help="the tokenizer's size, for tokenizers other than GPT-2 BPE")
    p.add_argument("--trust-checkpoint", action="store_true", help="unpickle the checkpoint's Python objects")
    p.add_argument("--no-optimizer", action="store_true", help="weights and progress only")
    args = p.parse_args(argv)
    found = _find(args.load, args.iteration)
    conv = upstream.read(found, args.trust_checkpoint, with_optimizer=not args.no_optimizer)
    first = upstream.first_args(found, args.trust_checkpoint)
    if args.vocab_file:
        vocab = _vocab_file_size(args.vocab_file)
    else:
        vocab = args.vocab_size or _tokenizer_size(first)
    if vocab is None:
        raise ConfigError(f"--vocab-file is needed: {found.path} names no GPT-2 vocab file found on this machine "
                          f"({first.get('vocab_file')!r}); pass --vocab-file VOCAB.json or the tokenizer's "
                          "--vocab-size (the checkpoint's vocabulary rows are padded)")
    if vocab > conv.padded_vocab_size:
        raise ConfigError(f"--vocab-size {vocab} is above the checkpoint's {conv.padded_vocab_size} vocabulary rows")
    weights = {k: (v[:vocab] if k in VOCAB_PARAMS else v) for k, v in conv.weights.items()}
    moments = None
    if conv.moments:
        moments = {n: {k: (t[:vocab] if n in VOCAB_PARAMS else t) for k, t in m.items()}
                   for n, m in conv.moments.items()}
    # The padding multiple is left out: it is a choice of the loading run, which keeps the loss equal when it pads
    # to upstream's row count (padded rows enter the softmax as zero logits here).
    model = {k: v for k, v in conv.model.items() if k != "make_vocab_size_divisible_by"}
    model.update(vocab_size=vocab, seq_length=first.get("seq_length"))
    progress = {"iteration": conv.iteration, "consumed_samples": conv.consumed_samples,
                "lr_num_steps": conv.lr_num_steps}
    write_full_state(args.save, weights, model, progress, found.path, moments, conv.optimizer_step)
    print(f"> read {found.kind} checkpoint {found.path}: {upstream.describe(conv)}")
    print(f"> Adam moments (step {conv.optimizer_step}) carried over" if moments else
          f"> Adam moments not carried ({conv.optimizer_note or '--no-optimizer'}): they restart")
    if conv.padded_vocab_size > vocab and found.kind != "universal":  # a universal one keeps no padding rows
        print(f"> upstream padded the vocabulary to {conv.padded_vocab_size} rows (its padding rows were trained "
              "into the softmax and are dropped here); the loss equals upstream's when the loading run pads to "
              f"{vocab} rows or accepts that shift (--make-vocab-size-divisible-by x TP)")
    gelu = " --openai-gelu" if model["openai_gelu"] else ""
    print(f"> wrote {args.save}: pass --load {args.save}{gelu} at any layout (upstream's tanh GeLU is our "
          "--openai-gelu)" if gelu else f"> wrote {args.save}: pass --load {args.save} at any layout")
    return 0


def _find(load: str, iteration: int | None):
    from megatron.checkpointing import upstream

    if iteration is not None:
        for kind, name in (("deepspeed", f"global_step{iteration}"), ("megatron", f"iter_{iteration:07d}")):
            path = os.path.join(load, name)
            if os.path.isdir(path):
                return upstream.Found(kind, path, iteration)
        raise CheckpointError(f"--load {load} has neither global_step{iteration}/ nor iter_{iteration:07d}/")
    base = os.path.basename(os.path.normpath(load))
    if base.startswith("global_step") and base.endswith("_universal"):  # one universal checkpoint's directory
        digits = "".join(c for c in base if c.isdigit())
        return upstream.Found("universal", load, int(digits) if digits else 0)
    if os.path.isfile(os.path.join(load, "latest_universal")) and not os.path.isfile(os.path.join(load, "latest")):
        return upstream.find(load, universal=True)
    if base.startswith("global_step") or base.startswith("iter_") or base == "release":  # one iteration's directory
        kind = "megatron" if not base.startswith("global_step") else "deepspeed"
        digits = "".join(c for c in base if c.isdigit())
        return upstream.Found(kind, load, int(digits) if digits else 0)
    found = upstream.find(load)
    if found is None:
        raise CheckpointError(f"--load {load} holds no Megatron-DeepSpeed global_stepN/ or Megatron iter_NNNNNNN/ "
                              "checkpoint (no 'latest' or latest_checkpointed_iteration.txt naming one)")
    return found


if __name__ == "__main__":
    sys.exit(run_cli(main))
