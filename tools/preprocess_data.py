"""Tokenize a jsonl corpus into Megatron ``.bin/.idx`` datasets (one per --json-keys key).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/my-corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 8

writes ``data/my-corpus_text_document.bin/.idx``; train with ``--data-path data/my-corpus_text_document``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import numpy as np

from megatron.data.indexed_dataset import (
    IndexedDatasetBuilder,
    best_token_dtype,
    data_file_path,
    index_file_path,
    merge_datasets,
)
from megatron.data.jsonl import BAD_LINES_CHOICES, BadLine, BadLineLog, parse_jsonl_line, require_file
from megatron.errors import ConfigError, DataError, MegatronError, run_cli
from megatron.tokenizer import TOKENIZER_TYPES, build_tokenizer


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="path to a jsonl file, one document per line")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract; one dataset per key")
    g.add_argument(
        "--bad-lines",
        choices=BAD_LINES_CHOICES,
        default="stop",
        help="a line that is not JSON or lacks a key: stop with its line number, or skip it with a warning",
    )
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", help="GPT2BPETokenizer vocab.json")
    g.add_argument("--merge-file", help="GPT2BPETokenizer merges.txt")
    g.add_argument("--tokenizer-model", help="HFTokenizer directory / tokenizer.json, or SentencePiece .model")
    g.add_argument("--vocab-size", type=int, help="NullTokenizer only: number of ids")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="write the input as N contiguous partial datasets, then merge them in order",
    )
    g.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    args = p.parse_args(argv)
    if args.workers < 1:
        raise ConfigError(f"--workers {args.workers} must be at least 1")
    if args.partitions < 1:
        raise ConfigError(f"--partitions {args.partitions} must be at least 1")
    return args


@dataclass
class PreprocessStats:
    documents: int
    tokens: int
    bytes_read: int
    seconds: float
    workers: int
    skipped_lines: int
    empty_documents: int
    outputs: list[str]

    @property
    def docs_per_second(self) -> float:
        return self.documents / max(self.seconds, 1e-9)


_W: dict = {}  # per-worker state, filled by _init_worker in each pool process


def _init_worker(tok_kwargs: dict, keys: list[str], append_eod: bool, dtype: type[np.number]) -> None:
    # A forked worker inherits the parent's Python signal handlers (a training process that calls preprocess() has
    # its graceful-stop SIGTERM handler): Pool.terminate() would then never end it and the parent's join hangs.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    tok = build_tokenizer(**tok_kwargs)
    _W.update(tok=tok, keys=keys, eod=tok.eod if append_eod else None, dtype=dtype)


def _encode(item: tuple[int, bytes]) -> tuple[int, int, dict[str, np.ndarray] | None, str | None]:
    """(line number, bytes, {key: ids} or None, reason the line is bad or None)."""
    lineno, raw = item
    if not raw.strip():
        return lineno, len(raw), {}, None
    try:
        texts = parse_jsonl_line(raw, _W["keys"])
        out = {}
        for key, text in texts.items():
            ids = _W["tok"].tokenize(text)
            if ids and _W["eod"] is not None:
                ids.append(_W["eod"])
            out[key] = np.asarray(ids, dtype=_W["dtype"])  # arrays pickle far faster than lists of ints
        return lineno, len(raw), out, None
    except (BadLine, MegatronError) as e:
        return lineno, len(raw), None, str(e)


def _count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)  # same notion of a line as the main loop, including an unterminated last one


def _remove_datasets(prefixes) -> None:
    for prefix in prefixes:
        for path in (data_file_path(prefix), index_file_path(prefix)):
            if os.path.exists(path):
                os.remove(path)


def preprocess(args: argparse.Namespace) -> PreprocessStats:
    """Tokenize ``args.input`` into ``args.output_prefix``_{key}_document datasets."""
    require_file(args.input)
    tok_kwargs = {
        "tokenizer_type": args.tokenizer_type,
        "vocab_file": args.vocab_file,
        "merge_file": args.merge_file,
        "tokenizer_model": args.tokenizer_model,
        "vocab_size": args.vocab_size,
    }
    tokenizer = build_tokenizer(**tok_kwargs)  # fail on bad tokenizer flags before starting workers
    if args.append_eod:
        _ = tokenizer.eod  # raises ConfigError now, not in every worker, if the tokenizer has no EOD token
    dtype = best_token_dtype(tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)

    finals = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    lines_per_part = -(-_count_lines(args.input) // args.partitions) if args.partitions > 1 else None
    part_prefixes: dict[str, list[str]] = {k: [] for k in args.json_keys}
    builders: dict[str, IndexedDatasetBuilder] = {}

    def open_part(part: int) -> None:
        for k in args.json_keys:
            prefix = finals[k] if lines_per_part is None else f"{finals[k]}_part{part}"
            part_prefixes[k].append(prefix)
            builders[k] = IndexedDatasetBuilder(data_file_path(prefix), dtype=dtype)

    def close_part() -> None:
        for k, b in builders.items():
            b.finalize(index_file_path(part_prefixes[k][-1]))

    log = BadLineLog(args.input, args.bad_lines)
    docs = tokens = nbytes = empty = 0
    t0 = last = time.time()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per core already; no Rust threads too
    pool = None
    try:
        if args.workers > 1:
            pool = multiprocessing.Pool(
                args.workers, _init_worker, (tok_kwargs, args.json_keys, args.append_eod, dtype)
            )
            mapper = pool.imap
        else:
            _init_worker(tok_kwargs, args.json_keys, args.append_eod, dtype)
            mapper = map
        part = 0
        open_part(part)
        with open(args.input, "rb") as f:
            kwargs = {"chunksize": 64} if pool else {}
            for lineno, size, out, reason in mapper(_encode, enumerate(f, 1), **kwargs):
                if lines_per_part is not None and lineno > (part + 1) * lines_per_part:
                    close_part()
                    part += 1
                    open_part(part)
                nbytes += size
                if reason is not None:
                    log.report(lineno, reason)
                    continue
                if not out:
                    continue
                if any(len(ids) == 0 for ids in out.values()):
                    empty += 1  # nothing to train on; Megatron drops empty documents too
                    continue
                for k, ids in out.items():
                    builders[k].add_document(ids)
                    tokens += len(ids)
                docs += 1
                if docs % args.log_interval == 0:
                    now = time.time()
                    print(
                        f"processed {docs} documents ({args.log_interval / (now - last):.0f} docs/s, "
                        f"{nbytes / 1e6 / (now - t0):.2f} MB/s)",
                        file=sys.stderr,
                        flush=True,
                    )
                    last = now
        close_part()
        if pool is not None:  # every line is back: let the workers finish rather than kill them
            pool.close()
            pool.join()
            pool = None
    except BaseException:
        for b in builders.values():
            b.close()
        written = {p for prefixes in part_prefixes.values() for p in prefixes} | set(finals.values())
        _remove_datasets(written)  # never leave a half-written dataset that looks complete
        raise
    finally:
        if pool is not None:
            pool.terminate()

    if lines_per_part is not None:
        for k in args.json_keys:
            merge_datasets(part_prefixes[k], finals[k])
            _remove_datasets(part_prefixes[k])
    if docs == 0:
        _remove_datasets(finals.values())
        raise DataError(
            f"--input {args.input} produced no documents (empty corpus: {empty} empty texts, "
            f"{log.count} bad lines); check the file and --json-keys {' '.join(args.json_keys)}"
        )
    seconds = time.time() - t0
    if log.summary():
        print(f"warning: {log.summary()}", file=sys.stderr, flush=True)
    print(
        f"done: {docs} documents, {tokens} tokens, {nbytes / 1e6:.1f} MB in {seconds:.1f}s "
        f"({docs / seconds:.0f} docs/s, {docs / seconds / args.workers:.0f} docs/s per worker, "
        f"{nbytes / 1e6 / seconds:.2f} MB/s) -> {', '.join(p + '.{bin,idx}' for p in finals.values())}",
        flush=True,
    )
    return PreprocessStats(docs, tokens, nbytes, seconds, args.workers, log.count, empty, list(finals.values()))


def main(argv: list[str] | None = None) -> int:
    preprocess(get_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
