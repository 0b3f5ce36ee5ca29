"""Export a checkpoint (any TP/PP/ZeRO layout, or a full-state directory) to HF transformers:
GPT2LMHeadModel for the GPT-2 variant, LlamaForCausalLM for the Llama variant (safetensors + config.json); a Llama
variant with experts (any EP/TP layout) to MixtralForCausalLM or Qwen2MoeForCausalLM (docs/moe.md says which).

    python tools/convert_checkpoint_to_hf.py --load CHECKPOINTS [--tag global_step100] --out HF_DIR

config.json gets bos/eos_token_id from the imported HF model, else the tokenizer the run was trained with
(its --tokenizer-* flags, saved in the checkpoint), else the --tokenizer-* flags given here.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.errors import run_cli  # noqa: E402


def main(argv=None) -> int:
    from megatron.checkpointing.hf.convert import read_any, write_hf
    from megatron.checkpointing.hf.moe import has_experts, match_notes
    from megatron.checkpointing.hf.tokens import special_ids_of_checkpoint

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="a --save directory, one tag directory, or a full-state directory")
    p.add_argument("--tag", default=None, help="default: the one 'latest' names")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer-type", default=None, help="default: the one the checkpoint was trained with")
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    p.add_argument("--tokenizer-model", default=None)
    args = p.parse_args(argv)
    full, model, progress = read_any(args.load, args.tag)
    special = special_ids_of_checkpoint(args.load, args.tag, vars(args))
    config = write_hf(args.out, full, model, special)
    for note in match_notes(model) if has_experts(model) else []:
        print(f"> note: {note}")
    ids = ", ".join(f"{k} {v}" for k, v in sorted(special.items())) or "no bos/eos ids (no tokenizer known)"
    print(f"> wrote {config['architectures'][0]} ({model['num_layers']} layers, iteration {progress['iteration']}; "
          f"{ids}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
