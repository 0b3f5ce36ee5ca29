"""Train a byte-level BPE tokenizer on local jsonl/text files; writes vocab.json, merges.txt and tokenizer.json.

    python tools/train_tokenizer.py --input corpus.jsonl --vocab-size 8192 --output-dir my-tokenizer

Use the result with ``--tokenizer-type GPT2BPETokenizer --vocab-file DIR/vocab.json --merge-file DIR/merges.txt``
or ``--tokenizer-type HFTokenizer --tokenizer-model DIR``; both give the same ids.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megatron.data.jsonl import BAD_LINES_CHOICES, iter_texts
from megatron.errors import ConfigError, DataError, run_cli

EOD_TOKEN = "<|endoftext|>"


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help=".jsonl files (text under --json-keys) or plain text")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="jsonl keys whose strings are trained on")
    p.add_argument("--vocab-size", type=int, default=8192, help="target size, including 256 bytes and EOD")
    p.add_argument("--min-frequency", type=int, default=2, help="a pair must occur this often to be merged")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--bad-lines", choices=BAD_LINES_CHOICES, default="stop", help="on a line that is not JSON")
    return p.parse_args(argv)


def train_tokenizer(args: argparse.Namespace) -> str:
    """Train and write the three files; returns the output directory."""
    from tokenizers import ByteLevelBPETokenizer

    if args.vocab_size < 257:
        raise ConfigError(f"--vocab-size {args.vocab_size} is too small: byte-level BPE needs 256 bytes + EOD")
    seen = {"docs": 0}

    def texts():
        for path in args.input:
            for text in iter_texts(path, args.json_keys, args.bad_lines):
                if text:
                    seen["docs"] += 1
                    yield text

    t0 = time.time()
    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(
        texts(),
        vocab_size=args.vocab_size,
        min_frequency=args.min_frequency,
        special_tokens=[EOD_TOKEN],
        show_progress=False,
    )
    if seen["docs"] == 0:
        raise DataError(f"--input {' '.join(args.input)} holds no text to train on (empty corpus)")
    os.makedirs(args.output_dir, exist_ok=True)
    tok.save_model(args.output_dir)  # vocab.json + merges.txt, GPT-2's file format
    tok.save(os.path.join(args.output_dir, "tokenizer.json"))
    print(
        f"trained byte-level BPE on {seen['docs']} documents in {time.time() - t0:.1f}s: "
        f"{tok.get_vocab_size()} tokens -> {args.output_dir}/{{vocab.json,merges.txt,tokenizer.json}}",
        flush=True,
    )
    return args.output_dir


def main(argv: list[str] | None = None) -> int:
    train_tokenizer(get_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
