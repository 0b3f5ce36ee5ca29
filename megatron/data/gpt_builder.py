"""The trainer's entry point to the data pipeline: --data-path / --split, or --train-data-path / --valid-data-path /
--test-data-path -> train, valid, test datasets, and the DataLoader that feeds one data-parallel rank."""

from __future__ import annotations

import functools
import glob
import math
import os
from collections.abc import Callable, Sequence

from megatron.config import DataConfig
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import IndexedDataset
from megatron.data.samplers import MegatronPretrainingRandomSampler, MegatronPretrainingSampler
from megatron.data.split import parse_split, split_boundaries
from megatron.errors import ConfigError, DataError

SPLIT_NAMES = ("train", "valid", "test")
# Each blended component gets this much more than its weighted share, so the greedy blend never runs short
# (upstream's 0.5%; the blend then holds the sum of these counts, as upstream's does).
_BLEND_MARGIN = 1.005


def blend_num_samples(wanted: int, weights: Sequence[float]) -> list[int]:
    """Samples asked of each blended data set for ``wanted`` in all: upstream's ceil(wanted x weight x 1.005)."""
    return [int(math.ceil(wanted * w * _BLEND_MARGIN)) for w in weights]


def parse_data_path(data_path: Sequence[str], flag: str = "--data-path") -> tuple[list[float], list[str]]:
    """``[p]`` -> ([1.0], [p]); ``[w1, p1, w2, p2, ...]`` -> (normalized weights, prefixes). ``flag``: the flag the
    list came from, named in the errors."""
    data_path = list(data_path)
    if not data_path:
        raise ConfigError(f"{flag} is empty: give PREFIX, or W1 PREFIX1 W2 PREFIX2 ... to blend")
    if len(data_path) == 1:
        return [1.0], data_path
    if len(data_path) % 2:
        raise ConfigError(
            f"{flag} has {len(data_path)} entries: to blend, give pairs 'W1 PREFIX1 W2 PREFIX2 ...' "
            f"(a weight before every prefix)"
        )
    weights, prefixes = [], []
    for w, p in zip(data_path[0::2], data_path[1::2], strict=True):
        try:
            weight = float(w)
        except ValueError:
            raise ConfigError(
                f"{flag}: {w!r} is not a weight; give 'W1 PREFIX1 W2 PREFIX2 ...' with a number before "
                f"every prefix"
            ) from None
        if not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"{flag}: weight {w!r} for {p} must be a non-negative number")
        weights.append(weight)
        prefixes.append(p)
    total = sum(weights)
    if total <= 0:
        raise ConfigError(f"{flag}: the weights sum to 0; give at least one positive weight")
    return [w / total for w in weights], prefixes


def check_train_split(split: str, ds: IndexedDataset, begin: int, end: int) -> None:
    """The train split must hold documents (valid/test may be empty)."""
    if end <= begin:
        raise ConfigError(
            f"--split {split} leaves the train split of {ds.prefix} with no documents (it has "
            f"{ds.num_documents}); give train a larger share, e.g. --split 969,30,1"
        )


def build_train_valid_test_datasets(
    data_path: list[str],
    split: str,
    seq_length: int,
    seed: int,
    train_valid_test_num_samples: tuple[int, int, int],
    data_cache_path: str | None,
    tokenizer_vocab_size: int | None,
    barrier: Callable[[], None] | None = None,
    build_on_this_rank: bool = True,
    log: Callable[[str], None] = print,
    per_epoch_order: bool = False,
) -> tuple:
    """(train, valid, test) of --data-path cut by --split; each is a GPTDataset, a BlendableDataset, or None when
    that split gets no samples (num_samples 0, or no documents for valid/test). ``dataset[i]["text"]`` is
    int64[seq_length + 1].

    Multi-rank: pass ``build_on_this_rank = (rank == 0)`` and a ``barrier`` callable (e.g.
    ``torch.distributed.barrier``); rank 0 builds the index caches, then every rank loads them.

    The order is upstream Megatron-DeepSpeed's for the same flags (``per_epoch_order``: our former order, opt-in).
    """
    weights, prefixes = parse_data_path(data_path)
    parse_split(split)  # a bad --split fails before any file is opened
    indexed = _open(prefixes, tokenizer_vocab_size)
    gpt = functools.partial(GPTDataset, seq_length=seq_length, seed=seed, cache_dir=data_cache_path, barrier=barrier,
                            build_on_this_rank=build_on_this_rank, log=log, split=split,
                            per_epoch_order=per_epoch_order)
    results = []
    for s, name in enumerate(SPLIT_NAMES):
        wanted = int(train_valid_test_num_samples[s])
        if wanted <= 0:
            results.append(None)
            continue
        counts = [wanted] if len(prefixes) == 1 else blend_num_samples(wanted, weights)
        parts, part_weights, part_counts = [], [], []
        for ds, weight, n in zip(indexed, weights, counts, strict=True):
            bounds = split_boundaries(split, ds.num_documents)
            begin, end = bounds[s], bounds[s + 1]
            if end <= begin:
                if name == "train" and weight > 0:
                    check_train_split(split, ds, begin, end)
                log(f"warning: --split {split} gives {name} no documents of {ds.prefix}; it is left out of {name}")
                continue
            # A weight-0 data set stays in the blend, as upstream keeps it: the blending index depends on it on ties.
            parts.append(gpt(name, ds, begin, end, num_samples=n))
            part_weights.append(weight)
            part_counts.append(n)
        results.append(_blend(parts, part_weights, part_counts, single=len(prefixes) == 1))
    return tuple(results)


def build_per_split_datasets(
    paths: tuple[Sequence[str] | None, Sequence[str] | None, Sequence[str] | None],
    split: str,
    seq_length: int,
    seed: int,
    train_valid_test_num_samples: tuple[int, int, int],
    data_cache_path: str | None,
    tokenizer_vocab_size: int | None,
    barrier: Callable[[], None] | None = None,
    build_on_this_rank: bool = True,
    log: Callable[[str], None] = print,
    per_epoch_order: bool = False,
) -> tuple:
    """(train, valid, test) of --train-data-path, --valid-data-path and --test-data-path, as upstream builds them:
    each split's corpora whole (every document), blended by their own weights; a split without a path, or given no
    samples, is None. ``split`` (--split) selects nothing and only names upstream's index cache, as upstream's
    description hashes it. The other arguments are build_train_valid_test_datasets's."""
    parse_split(split)
    parsed = [parse_data_path(p, FLAGS[s]) if p is not None else None for s, p in enumerate(paths)]
    indexed = [_open(p[1], tokenizer_vocab_size, FLAGS[s]) if p is not None else None
               for s, p in enumerate(parsed)]  # all, before any build
    gpt = functools.partial(GPTDataset, seq_length=seq_length, seed=seed, cache_dir=data_cache_path, barrier=barrier,
                            build_on_this_rank=build_on_this_rank, log=log, split=split,
                            per_epoch_order=per_epoch_order)
    results = []
    for s, name in enumerate(SPLIT_NAMES):
        wanted = int(train_valid_test_num_samples[s])
        if parsed[s] is None or wanted <= 0:
            results.append(None)
            continue
        weights = parsed[s][0]
        counts = [wanted] if len(weights) == 1 else blend_num_samples(wanted, weights)
        parts = [gpt(name, ds, 0, ds.num_documents, num_samples=n)
                 for ds, n in zip(indexed[s], counts, strict=True)]
        results.append(_blend(parts, weights, counts, single=len(weights) == 1))
    return tuple(results)


FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")
"""The per-split data flags, in SPLIT_NAMES's order."""


def _open(prefixes: list[str], tokenizer_vocab_size: int | None, flag: str = "--data-path") -> list[IndexedDataset]:
    """Every prefix opened and its token ids checked against the tokenizer, before any index is built."""
    return [open_prefix(prefix, tokenizer_vocab_size, flag) for prefix in prefixes]


def open_prefix(prefix: str, vocab_size: int | None, flag: str = "--data-path") -> IndexedDataset:
    """The PREFIX.bin/.idx pair opened (magic, version, dtype, both files' sizes) and its token ids checked against
    the vocabulary (None: not known, e.g. a dry run without a tokenizer)."""
    if os.path.isdir(prefix):
        found = sorted(glob.glob(os.path.join(prefix, "*.idx")))
        example = f", e.g. {flag} {found[0][:-len('.idx')]}" if found else ""
        raise DataError(f"{flag} {prefix} is a directory: give the prefix of a PREFIX.bin/PREFIX.idx pair{example}")
    ds = IndexedDataset(prefix)
    ds.check_vocab(vocab_size)
    return ds


def data_files(data: DataConfig) -> list[tuple[str, list[float], list[str]]]:
    """(flag, normalized weights, prefixes) of every data-file flag given (each list parsed and checked)."""
    if data.data_path:
        return [("--data-path", *parse_data_path(data.data_path))]
    return [(flag, *parse_data_path(paths, flag)) for flag, paths in zip(FLAGS, data.split_paths(), strict=True)
            if paths is not None]


def check_data_files(data: DataConfig, vocab_size: int | None) -> int:
    """Every data file of the run opened and checked (open_prefix); returns how many prefixes."""
    checked = 0
    for flag, _, prefixes in data_files(data):
        for prefix in prefixes:
            open_prefix(prefix, vocab_size, flag)
            checked += 1
    return checked


def _blend(parts: list, weights: list[float], counts: list[int], single: bool):
    """One split's data set: its one corpus, upstream's blend of its parts (sized by the sum of their counts, as
    upstream's), or None when nothing is left with a positive weight."""
    if not parts or sum(weights) <= 0:
        return None
    return parts[0] if single else BlendableDataset(parts, weights, sum(counts))


class NumberedSamples:
    """A data set whose samples also carry their index (``sample_index``): the MoE gates draw their random numbers
    from it (megatron/core/moe/draws.py), so every layout draws the same ones for the same sample."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict:
        return {**self.dataset[idx], "sample_index": idx}


def build_data_loader(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    dataloader_type: str = "single",
    seed: int = 0,
    data_sharding: bool = True,
):
    """A torch DataLoader over this rank's micro-batches; batches are ``{"text": LongTensor[b, seq_length+1],
    "sample_index": LongTensor[b]}``.

    ``dataloader_type`` is Megatron's: "single" (sequential, the default) or "cyclic" (shuffled per epoch; one pass
    of the loader is one epoch). The batches are upstream's samplers' for the same consumed count.
    ``seed`` seeds only the loader's worker generator (upstream's cyclic order does not depend on it).
    """
    import torch  # the data package imports without torch (tools/preprocess_data.py workers)

    if dataloader_type == "single":
        sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    elif dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(
            len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size, data_sharding=data_sharding
        )
    else:
        raise ConfigError(f"--dataloader-type {dataloader_type!r} must be 'single' or 'cyclic'")
    # Its own generator: a DataLoader iterator otherwise draws its worker base seed from the global torch RNG
    # at the first next(), which shifts dropout masks after a resume (the RNG is restored before that draw).
    return torch.utils.data.DataLoader(
        NumberedSamples(dataset), batch_sampler=sampler, num_workers=num_workers, pin_memory=False,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed + consumed_samples),
    )
