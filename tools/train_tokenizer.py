"""Train a tokenizer on local jsonl/text files: byte-level BPE (vocab.json, merges.txt, tokenizer.json) or, with
``--format sentencepiece``, a Llama-style SentencePiece model (tokenizer.model).

    python tools/train_tokenizer.py --input corpus.jsonl --vocab-size 8192 --output-dir my-tokenizer

Use a BPE result with ``--tokenizer-type GPT2BPETokenizer --vocab-file DIR/vocab.json --merge-file DIR/merges.txt``
or ``--tokenizer-type HFTokenizer --tokenizer-model DIR`` (both give the same ids); a SentencePiece one with
``--tokenizer-type GPTSentencePieceTokenizer`` (or Llama2Tokenizer) ``--tokenizer-model DIR/tokenizer.model``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import NoReturn

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
    p.add_argument("--format", choices=["gpt2-bpe", "sentencepiece"], default="gpt2-bpe",
                   help="gpt2-bpe: byte-level BPE files; sentencepiece: DIR/tokenizer.model as Llama's (BPE with byte "
                        "fallback, unk 0 / bos 1 / eos 2, no pad)")
    p.add_argument("--bad-lines", choices=BAD_LINES_CHOICES, default="stop", help="on a line that is not JSON")
    return p.parse_args(argv)


def train_tokenizer(args: argparse.Namespace) -> str:
    """Train and write the files; returns the output directory."""
    if args.format == "sentencepiece":
        return _train_sentencepiece(args)
    from tokenizers import ByteLevelBPETokenizer

    if args.vocab_size < 257:
        raise ConfigError(f"--vocab-size {args.vocab_size} is too small: byte-level BPE needs 256 bytes + EOD")
    seen = {"docs": 0}
    t0 = time.time()
    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(
        _texts(args, seen),
        vocab_size=args.vocab_size,
        min_frequency=args.min_frequency,
        special_tokens=[EOD_TOKEN],
        show_progress=False,
    )
    if seen["docs"] == 0:
        _empty_corpus(args)
    os.makedirs(args.output_dir, exist_ok=True)
    tok.save_model(args.output_dir)  # vocab.json + merges.txt, GPT-2's file format
    tok.save(os.path.join(args.output_dir, "tokenizer.json"))
    print(
        f"trained byte-level BPE on {seen['docs']} documents in {time.time() - t0:.1f}s: "
        f"{tok.get_vocab_size()} tokens -> {args.output_dir}/{{vocab.json,merges.txt,tokenizer.json}}",
        flush=True,
    )
    return args.output_dir


def _empty_corpus(args: argparse.Namespace) -> NoReturn:
    raise DataError(f"--input {' '.join(args.input)} holds no text to train on (empty corpus)")


def _texts(args: argparse.Namespace, seen: dict):
    for path in args.input:
        for text in iter_texts(path, args.json_keys, args.bad_lines):
            if text:
                seen["docs"] += 1
                yield text


def _train_sentencepiece(args: argparse.Namespace) -> str:
    try:
        import sentencepiece as spm
    except ImportError:
        raise ConfigError("--format sentencepiece needs the sentencepiece package: pip install sentencepiece") from None
    # 3 special pieces + 256 byte-fallback pieces come first; below that nothing is left for merges.
    if args.vocab_size < 260:
        raise ConfigError(f"--vocab-size {args.vocab_size} is too small for --format sentencepiece: it needs 259 "
                          "special and byte pieces plus at least one more")
    seen = {"docs": 0}
    texts = list(_texts(args, seen))  # the trainer needs the whole corpus anyway
    if not texts:
        _empty_corpus(args)
    os.makedirs(args.output_dir, exist_ok=True)
    prefix = os.path.join(args.output_dir, "tokenizer")
    t0 = time.time()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_prefix=prefix, vocab_size=args.vocab_size, model_type="bpe",
            byte_fallback=True, normalization_rule_name="identity", character_coverage=1.0, unk_id=0, bos_id=1,
            eos_id=2, pad_id=-1, hard_vocab_limit=False, minloglevel=2,  # a small corpus may give fewer pieces
        )
    except RuntimeError as e:
        raise DataError(f"SentencePiece training on {' '.join(args.input)} failed: {str(e).strip()[:200]}") from None
    size = spm.SentencePieceProcessor(model_file=prefix + ".model").get_piece_size()
    print(f"trained SentencePiece BPE on {seen['docs']} documents in {time.time() - t0:.1f}s: {size} pieces -> "
          f"{prefix}.model", flush=True)
    return args.output_dir


def main(argv: list[str] | None = None) -> int:
    train_tokenizer(get_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
