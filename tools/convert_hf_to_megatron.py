"""Import a local HF GPT-2 / Llama model directory as a full-state directory that ``pretrain_gpt.py --load``
reads at any TP/PP/ZeRO layout (continue pretraining; the optimizer starts fresh). Mixtral and Qwen2-MoE (without a
shared expert) import as a model with experts (docs/moe.md#hf-export).

    python tools/convert_hf_to_megatron.py --hf HF_DIR --out FULL_STATE_DIR
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.errors import run_cli  # noqa: E402


def main(argv=None) -> int:
    from megatron.checkpointing.hf.convert import hf_to_full_state
    from megatron.checkpointing.hf.dense import matching_flags

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--hf", required=True, help="local directory with config.json and *.safetensors")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    m = hf_to_full_state(args.hf, args.out)
    # --vocab-size is for --mock-data / NullTokenizer; with --data-path the tokenizer must have that many entries.
    print(f"> wrote {args.out}; train with --load {args.out} {' '.join(matching_flags(m))}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
