"""GPTDataset: fixed-length samples of seq_length+1 tokens drawn from a document range of an IndexedDataset.

Three index arrays make a sample O(1) to fetch and the order reproducible from (seed, description) alone:
doc_idx (documents, shuffled per epoch), sample_idx (where each sample starts in doc_idx, built in C++) and
shuffle_idx (sample order). They are cached as .npy files keyed by the md5 of the dataset description, which
includes a content fingerprint of the .bin/.idx pair (megatron/data/fingerprint.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable

import numpy as np

from megatron.data.fingerprint import content_fingerprint
from megatron.data.helpers import build_sample_idx
from megatron.data.indexed_dataset import IndexedDataset, index_file_path
from megatron.errors import ConfigError, DataError

_INDEX_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``969/30/1``) -> three normalized train/valid/test fractions."""
    try:
        parts = [float(s) for s in split.replace("/", ",").split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--split {split!r} must be up to three numbers such as 969,30,1") from None
    if not parts or len(parts) > 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ConfigError(
            f"--split {split!r} must be up to three non-negative numbers with a positive sum, e.g. 969,30,1"
        )
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_boundaries(split: str, num_documents: int) -> list[int]:
    """Document index boundaries ``[0, end_train, end_valid, num_documents]`` for --split."""
    fractions = parse_split(split)
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + round(f * num_documents))
    # Rounding can overshoot or undershoot by a document or two; the test split absorbs it.
    bounds[-1] = num_documents
    for i in (1, 2):
        bounds[i] = min(bounds[i], num_documents)
    return bounds


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens (inputs and shifted labels) that run across document boundaries.

    The documents ``[doc_begin, doc_end)`` are repeated for as many epochs as ``num_samples`` needs. Index
    arrays are built only where ``build_on_this_rank`` is true; every rank then calls ``barrier()`` (if given)
    and loads them from ``cache_dir``, which must therefore be visible to all ranks.
    """

    def __init__(
        self,
        name: str,
        indexed: IndexedDataset,
        doc_begin: int,
        doc_end: int,
        num_samples: int,
        seq_length: int,
        seed: int,
        cache_dir: str | None = None,
        barrier: Callable[[], None] | None = None,
        build_on_this_rank: bool = True,
        log: Callable[[str], None] = print,
    ) -> None:
        if seq_length <= 0:
            raise ConfigError(f"--seq-length {seq_length} must be positive")
        self.name, self.indexed, self.seq_length = name, indexed, seq_length
        self.documents = np.arange(doc_begin, doc_end, dtype=np.int64)
        self.tokens_per_epoch = int(indexed.sizes[doc_begin:doc_end].astype(np.int64).sum())
        if self.tokens_per_epoch <= 1:
            raise DataError(
                f"the {name} split of {indexed.prefix} (documents {doc_begin}..{doc_end}) holds "
                f"{self.tokens_per_epoch} tokens, too few for one sample; use more data or change --split"
            )
        need = num_samples * seq_length + 1
        self.num_epochs = max(1, -(-need // self.tokens_per_epoch))
        self.description = {
            "class": "GPTDataset",
            "format": 1,  # bump when the index layout or the build algorithm changes
            "prefix": os.path.abspath(indexed.prefix),
            "idx_bytes": os.path.getsize(index_file_path(indexed.prefix)),
            "content": content_fingerprint(indexed.prefix),  # a rewrite of the same size must not reuse the cache
            "split": name,
            "documents": [doc_begin, doc_end],
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
        }
        text = json.dumps(self.description, sort_keys=True)
        self.hash = hashlib.md5(text.encode("utf-8")).hexdigest()
        if cache_dir is None:
            cache_dir = os.path.join(os.path.dirname(os.path.abspath(indexed.prefix)), "cache", "GPTDataset_indices")
        self.cache_dir = cache_dir
        paths = {k: os.path.join(cache_dir, f"{self.hash}-{name}-{k}.npy") for k in _INDEX_NAMES}

        if build_on_this_rank and not all(os.path.isfile(p) for p in paths.values()):
            _note_changed_content(cache_dir, self.description, log)
            t0 = time.time()
            arrays = self._build(seed)
            _save_atomic(cache_dir, paths, arrays, text)
            log(
                f"built {name} indices for {indexed.prefix}: {len(arrays['shuffle_idx'])} samples, "
                f"{self.num_epochs} epoch(s), in {time.time() - t0:.2f}s -> {cache_dir}"
            )
        if barrier is not None:
            barrier()
        missing = [p for p in paths.values() if not os.path.isfile(p)]
        if missing:
            raise DataError(
                f"{missing[0]} not found after rank 0 built it: --data-cache-path must be a directory that "
                f"every rank can read (a shared filesystem such as Lustre on Frontier)",
                every_rank=True,  # rank 0 found its files: only the ranks that cannot see them know
            )
        self.doc_idx, self.sample_idx, self.shuffle_idx = (np.load(paths[k], mmap_mode="r") for k in _INDEX_NAMES)

    def _build(self, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.RandomState(seed)
        # Each epoch is its own permutation, so every document is seen once before any is repeated.
        doc_idx = np.concatenate([rng.permutation(self.documents) for _ in range(self.num_epochs)])
        total_tokens = self.num_epochs * self.tokens_per_epoch
        num_samples = (total_tokens - 1) // self.seq_length
        sample_idx = build_sample_idx(self.indexed.sizes, doc_idx, self.seq_length, num_samples)
        # Shuffle samples of the complete epochs apart from those of the last one (often partial), so the
        # samples a run actually consumes cover the complete epochs rather than a random mix of all.
        full = max(((self.num_epochs - 1) * self.tokens_per_epoch - 1) // self.seq_length, 0)
        dtype = np.uint32 if num_samples < np.iinfo(np.uint32).max else np.int64
        head = np.arange(full, dtype=dtype)
        tail = np.arange(full, num_samples, dtype=dtype)
        rng.shuffle(head)
        rng.shuffle(tail)
        return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": np.concatenate([head, tail])}

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {self.name} dataset of {len(self)} samples")
        i = int(self.shuffle_idx[idx])
        first_doc, first_off = (int(v) for v in self.sample_idx[i])
        last_doc, last_off = (int(v) for v in self.sample_idx[i + 1])
        if first_doc == last_doc:
            tokens = self.indexed.get(int(self.doc_idx[first_doc]), first_off, last_off - first_off + 1)
        else:
            parts = [self.indexed.get(int(self.doc_idx[first_doc]), first_off)]
            parts += [self.indexed.get(int(self.doc_idx[d])) for d in range(first_doc + 1, last_doc)]
            parts.append(self.indexed.get(int(self.doc_idx[last_doc]), 0, last_off + 1))
            tokens = np.concatenate(parts)
        return {"text": tokens.astype(np.int64)}


_said_changed: set[str] = set()


def _note_changed_content(cache_dir: str, description: dict, log: Callable[[str], None]) -> None:
    """Before a rebuild: if this data set (same prefix, split, samples, seed) was cached with other content, say so
    once per data set per process, and remember the content now being indexed."""
    place = {k: v for k, v in description.items() if k != "content"}
    marker = os.path.join(cache_dir, hashlib.md5(json.dumps(place, sort_keys=True).encode()).hexdigest()
                          + "-content.json")
    try:
        with open(marker) as f:
            before = json.load(f)
    except (OSError, ValueError):
        before = None
    if before is not None and before != description["content"] and description["prefix"] not in _said_changed:
        _said_changed.add(description["prefix"])
        log(f"{description['prefix']}.bin/.idx changed since its cached indices were built (content fingerprint "
            "differs): rebuilding them")
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with open(f"{marker}.tmp{os.getpid()}", "w") as f:
            json.dump(description["content"], f)
        os.replace(f"{marker}.tmp{os.getpid()}", marker)
    except OSError:
        pass  # the marker only serves the message; _save_atomic reports an unwritable cache directory


def _save_atomic(cache_dir: str, paths: dict[str, str], arrays: dict[str, np.ndarray], description: str) -> None:
    """Write under temporary names and rename, so a rank never loads a half-written index."""
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for key, path in paths.items():
            tmp = f"{path}.tmp{os.getpid()}.npy"
            np.save(tmp, arrays[key], allow_pickle=False)
            os.replace(tmp, path)
        with open(paths["doc_idx"].replace("-doc_idx.npy", "-description.json"), "w") as f:
            f.write(description)
    except OSError as e:
        raise DataError(f"cannot write dataset index cache in {cache_dir} ({e}); set --data-cache-path") from None
