"""Pre-flight checks of --data-path and --split: every prefix opens (magic, version, dtype, sizes of both
files), its token ids fit the tokenizer, the train split has documents, and enough tokens for one iteration."""

from __future__ import annotations

import glob
import math
import os

import numpy as np

from megatron.config import RunConfig
from megatron.data.gpt_builder import check_train_split, parse_data_path
from megatron.data.indexed_dataset import IndexedDataset
from megatron.data.split import parse_split, split_boundaries
from megatron.errors import ConfigError, DataError, warn_once

# More epochs than this over the train split is legal but rarely meant (a small corpus, a long run): say so.
MANY_EPOCHS = 4


def check_data(run: RunConfig) -> None:
    data = run.data
    if not data.data_path:
        if data.per_epoch_doc_shuffle:  # mock/demo data have no document order to change
            raise ConfigError("--per-epoch-doc-shuffle orders the documents of --data-path: drop it, or give "
                              "--data-path")
        return
    weights, prefixes = parse_data_path(data.data_path)
    parse_split(data.split)
    seq, t = run.model.seq_length, run.training
    for weight, prefix in zip(weights, prefixes, strict=True):
        if os.path.isdir(prefix):
            raise DataError(f"--data-path {prefix} is a directory: give the prefix of a PREFIX.bin/PREFIX.idx "
                            f"pair{_example(prefix)}")
        ds = IndexedDataset(prefix)
        ds.check_vocab(run.model.vocab_size)
        if weight == 0:
            continue
        begin, end = split_boundaries(data.split, ds.num_documents)[:2]
        check_train_split(data.split, ds, begin, end)
        tokens = int(ds.sizes[begin:end].astype(np.int64).sum())
        check_tokens(prefix, tokens, seq, max(1, math.ceil(t.global_batch_size * weight)),
                     math.ceil(t.train_iters * t.global_batch_size * weight))


def check_tokens(prefix: str, tokens: int, seq_length: int, samples_per_iteration: int, samples: int) -> None:
    """Refuse a train split that cannot fill one iteration without repeating itself inside a sample; warn
    once (rank 0) when the run will go over it more than MANY_EPOCHS times."""
    need = samples_per_iteration * (seq_length + 1)
    if tokens < need:
        raise DataError(
            f"--data-path {prefix}: its train split holds {tokens} tokens, fewer than one iteration needs "
            f"({samples_per_iteration} samples x (--seq-length {seq_length} + 1) = {need}); every sample would "
            "repeat the corpus: use more data, a shorter --seq-length or a smaller --global-batch-size")
    epochs = -(-(samples * seq_length + 1) // tokens)  # as GPTDataset counts them
    if epochs > MANY_EPOCHS:
        warn_once(f"--data-path {prefix}: --train-iters needs {epochs} epochs over its train split of {tokens} "
                  f"tokens; every sample repeats {epochs} times (more data, or fewer --train-iters, if unintended)")


def _example(directory: str) -> str:
    """``, e.g. --data-path DIR/x_text_document`` when the directory holds an index, else nothing."""
    found = sorted(glob.glob(os.path.join(directory, "*.idx")))
    return f", e.g. --data-path {found[0][:-len('.idx')]}" if found else ""
