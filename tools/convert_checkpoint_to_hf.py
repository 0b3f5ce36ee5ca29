"""Export a checkpoint (any TP/PP/ZeRO layout, or a full-state directory) to HF transformers:
GPT2LMHeadModel for the GPT-2 variant, LlamaForCausalLM for the Llama variant (safetensors + config.json).

    python tools/convert_checkpoint_to_hf.py --load CHECKPOINTS [--tag global_step100] --out HF_DIR
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.errors import run_cli  # noqa: E402


def main(argv=None) -> int:
    from megatron.checkpointing.convert import read_any, write_hf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="a --save directory, one tag directory, or a full-state directory")
    p.add_argument("--tag", default=None, help="default: the one 'latest' names")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    full, model, progress = read_any(args.load, args.tag)
    config = write_hf(args.out, full, model)
    print(f"> wrote {config['architectures'][0]} ({model['num_layers']} layers, iteration {progress['iteration']}) "
          f"to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
