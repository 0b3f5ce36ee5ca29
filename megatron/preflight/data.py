"""Pre-flight checks of --data-path and --split, or of the per-split paths: every prefix opens (magic, version,
dtype, sizes of both files), its token ids fit the tokenizer, the train split has documents, and enough tokens for
one iteration."""

from __future__ import annotations

import math

import numpy as np

from megatron.config import RunConfig
from megatron.data.gpt_builder import check_train_split, data_files, open_prefix
from megatron.data.split import parse_split, split_boundaries
from megatron.errors import ConfigError, DataError, warn_once

# More epochs than this over the train split is legal but rarely meant (a small corpus, a long run): say so.
MANY_EPOCHS = 4


def check_data(run: RunConfig) -> None:
    data = run.data
    if not data.files:
        if data.per_epoch_doc_shuffle:  # mock/demo data have no document order to change
            raise ConfigError("--per-epoch-doc-shuffle orders the documents of --data-path: drop it, or give "
                              "--data-path")
        return
    parse_split(data.split)
    seq, t = run.model.seq_length, run.training
    for flag, weights, prefixes in data_files(data):
        for weight, prefix in zip(weights, prefixes, strict=True):
            ds = open_prefix(prefix, run.model.vocab_size, flag)
            if weight == 0 or flag in ("--valid-data-path", "--test-data-path"):
                continue
            begin, end = (0, ds.num_documents) if data.per_split else split_boundaries(data.split,
                                                                                      ds.num_documents)[:2]
            if not data.per_split:
                check_train_split(data.split, ds, begin, end)
            tokens = int(ds.sizes[begin:end].astype(np.int64).sum())
            check_tokens(prefix, tokens, seq, max(1, math.ceil(t.global_batch_size * weight)),
                         math.ceil(t.train_iters * t.global_batch_size * weight), flag)


def check_tokens(prefix: str, tokens: int, seq_length: int, samples_per_iteration: int, samples: int,
                 flag: str = "--data-path") -> None:
    """Refuse a train split that cannot fill one iteration without repeating itself inside a sample; warn
    once (rank 0) when the run will go over it more than MANY_EPOCHS times."""
    need = samples_per_iteration * (seq_length + 1)
    if tokens < need:
        raise DataError(
            f"{flag} {prefix}: its train split holds {tokens} tokens, fewer than one iteration needs "
            f"({samples_per_iteration} samples x (--seq-length {seq_length} + 1) = {need}); every sample would "
            "repeat the corpus: use more data, a shorter --seq-length or a smaller --global-batch-size")
    epochs = -(-(samples * seq_length + 1) // tokens)  # as GPTDataset counts them
    if epochs > MANY_EPOCHS:
        warn_once(f"{flag} {prefix}: --train-iters needs {epochs} epochs over its train split of {tokens} "
                  f"tokens; every sample repeats {epochs} times (more data, or fewer --train-iters, if unintended)")
