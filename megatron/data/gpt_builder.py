"""The trainer's entry point to the data pipeline: --data-path / --split -> train, valid, test datasets, and the
DataLoader that feeds one data-parallel rank."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import IndexedDataset
from megatron.data.samplers import MegatronPretrainingRandomSampler, MegatronPretrainingSampler
from megatron.data.split import parse_split, split_boundaries
from megatron.errors import ConfigError

SPLIT_NAMES = ("train", "valid", "test")
# Each blended component gets this much more than its weighted share, so the greedy blend never runs short
# (upstream's 0.5%; the blend then holds the sum of these counts, as upstream's does).
_BLEND_MARGIN = 1.005


def blend_num_samples(wanted: int, weights: Sequence[float]) -> list[int]:
    """Samples asked of each blended data set for ``wanted`` in all: upstream's ceil(wanted x weight x 1.005)."""
    return [int(math.ceil(wanted * w * _BLEND_MARGIN)) for w in weights]


def parse_data_path(data_path: Sequence[str]) -> tuple[list[float], list[str]]:
    """``[p]`` -> ([1.0], [p]); ``[w1, p1, w2, p2, ...]`` -> (normalized weights, prefixes)."""
    data_path = list(data_path)
    if not data_path:
        raise ConfigError("--data-path is empty: give PREFIX, or W1 PREFIX1 W2 PREFIX2 ... to blend")
    if len(data_path) == 1:
        return [1.0], data_path
    if len(data_path) % 2:
        raise ConfigError(
            f"--data-path has {len(data_path)} entries: to blend, give pairs 'W1 PREFIX1 W2 PREFIX2 ...' "
            f"(a weight before every prefix)"
        )
    weights, prefixes = [], []
    for w, p in zip(data_path[0::2], data_path[1::2], strict=True):
        try:
            weight = float(w)
        except ValueError:
            raise ConfigError(
                f"--data-path: {w!r} is not a weight; give 'W1 PREFIX1 W2 PREFIX2 ...' with a number before "
                f"every prefix"
            ) from None
        if not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"--data-path: weight {w!r} for {p} must be a non-negative number")
        weights.append(weight)
        prefixes.append(p)
    total = sum(weights)
    if total <= 0:
        raise ConfigError("--data-path: the weights sum to 0; give at least one positive weight")
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
    """(train, valid, test); each is a GPTDataset, a BlendableDataset, or None when that split gets no samples
    (num_samples 0, or no documents for valid/test). ``dataset[i]["text"]`` is int64[seq_length + 1].

    Multi-rank: pass ``build_on_this_rank = (rank == 0)`` and a ``barrier`` callable (e.g.
    ``torch.distributed.barrier``); rank 0 builds the index caches, then every rank loads them.

    The order is upstream Megatron-DeepSpeed's for the same flags (``per_epoch_order``: our former order, opt-in).
    """
    weights, prefixes = parse_data_path(data_path)
    parse_split(split)  # a bad --split fails before any file is opened
    indexed = []
    for prefix in prefixes:
        ds = IndexedDataset(prefix)
        ds.check_vocab(tokenizer_vocab_size)
        indexed.append(ds)

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
            gpt = GPTDataset(
                name,
                ds,
                begin,
                end,
                num_samples=n,
                seq_length=seq_length,
                seed=seed,
                cache_dir=data_cache_path,
                barrier=barrier,
                build_on_this_rank=build_on_this_rank,
                log=log,
                split=split,
                per_epoch_order=per_epoch_order,
            )
            parts.append(gpt)
            part_weights.append(weight)
            part_counts.append(n)
        if not parts or sum(part_weights) <= 0:
            results.append(None)
        elif len(prefixes) == 1:
            results.append(parts[0])
        else:
            results.append(BlendableDataset(parts, part_weights, sum(part_counts)))
    return tuple(results)


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
