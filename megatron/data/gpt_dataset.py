"""GPTDataset: fixed-length samples of seq_length+1 tokens drawn from a document range of an IndexedDataset.

Three index arrays make a sample O(1) to fetch and the order reproducible from (seed, description) alone:
doc_idx (documents of all epochs, shuffled), sample_idx (where each sample starts in doc_idx, built in C++) and
shuffle_idx (sample order), built exactly as upstream Megatron-DeepSpeed builds them (megatron/data/index_build.py).
They are cached as .npy files keyed by the md5 of the dataset description, which includes a content fingerprint of
the .bin/.idx pair (megatron/data/fingerprint.py); upstream's own cache is reused (megatron/data/upstream_cache.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable

import numpy as np

from megatron.data.fingerprint import content_fingerprint
from megatron.data.index_build import build_per_epoch_order, build_upstream_order, num_epochs
from megatron.data.indexed_dataset import IndexedDataset, index_file_path
from megatron.data.upstream_cache import (
    check_upstream_arrays,
    find_upstream,
    load_upstream,
    split_spellings,
    upstream_description,
)
from megatron.errors import ConfigError, DataError

_INDEX_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens (inputs and shifted labels) that run across document boundaries.

    The documents ``[doc_begin, doc_end)`` are repeated for as many epochs as ``num_samples`` needs, in upstream
    Megatron-DeepSpeed's order (megatron/data/index_build.py) unless ``per_epoch_order``. Index arrays are built only
    where ``build_on_this_rank`` is true; every rank then calls ``barrier()`` (if given) and loads them from
    ``cache_dir``, which must therefore be visible to all ranks. An upstream cache for the same run (``split`` is the
    --split string as given; the prefix is compared as given too, as upstream names its files by it) is used in
    place of a build when it checks out against the documents (megatron/data/upstream_cache.py).
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
        split: str | None = None,
        per_epoch_order: bool = False,
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
        self.num_epochs = num_epochs(self.tokens_per_epoch, seq_length, num_samples)
        self.num_samples, self.per_epoch_order = num_samples, per_epoch_order
        self.description = {
            "class": "GPTDataset",
            "format": 2,  # bump when the index layout or the build algorithm changes (2: upstream's order)
            "order": "per-epoch" if per_epoch_order else "upstream",
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
        # Upstream's own cache for this run, if one exists (only its order can be reused).
        self.upstream_descriptions = [
            upstream_description(indexed.prefix, name, num_samples, self.num_epochs, seq_length, seed, spelling)
            for spelling in split_spellings(split)] if split is not None and not per_epoch_order else []
        if cache_dir is None:
            cache_dir = os.path.join(os.path.dirname(os.path.abspath(indexed.prefix)), "cache", "GPTDataset_indices")
        self.cache_dir = cache_dir
        paths = {k: os.path.join(cache_dir, f"{self.hash}-{name}-{k}.npy") for k in _INDEX_NAMES}

        self.index_source = "ours"
        if build_on_this_rank and not all(os.path.isfile(p) for p in paths.values()):
            arrays = self._upstream_cache(cache_dir, log)
            if arrays is None:
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
        if self.index_source == "upstream":
            paths = self.upstream_paths
        elif not build_on_this_rank and not all(os.path.isfile(p) for p in paths.values()) and not per_epoch_order:
            # No cache of ours after the barrier: the building rank accepted upstream's (it builds ours otherwise).
            found, _ = find_upstream(indexed.prefix, cache_dir, self.upstream_descriptions)
            if found is not None:
                paths, self.index_source = found, "upstream"
        missing = [p for p in paths.values() if not os.path.isfile(p)]
        if missing:
            raise DataError(
                f"{missing[0]} not found after rank 0 built it: --data-cache-path must be a directory that "
                f"every rank can read (a shared filesystem such as Lustre on Frontier)",
                every_rank=True,  # rank 0 found its files: only the ranks that cannot see them know
            )
        self.doc_idx, self.sample_idx, self.shuffle_idx = (np.load(paths[k], mmap_mode="r") for k in _INDEX_NAMES)

    def _upstream_cache(self, cache_dir: str, log: Callable[[str], None]) -> dict | None:
        """Upstream's arrays for this run when a cache of them exists and checks out against the documents, else None
        (with one log line when a candidate was refused)."""
        if not self.upstream_descriptions:
            return None
        paths, why = find_upstream(self.indexed.prefix, cache_dir, self.upstream_descriptions)
        if paths is not None:
            arrays, why = load_upstream(paths, lambda a: check_upstream_arrays(
                a, self.documents, self.indexed.sizes, self.num_samples, self.seq_length, self.num_epochs))
            if arrays is not None:
                self.index_source, self.upstream_paths = "upstream", paths
                log(f"reusing upstream's {self.name} indices for {self.indexed.prefix}: {paths['doc_idx']} (and "
                    f"its _sample_idx/_shuffle_idx)")
                return arrays
            why = f"{paths['doc_idx']} and its siblings: {why}"
        if why:
            log(f"not reusing upstream's {self.name} index cache ({why}): rebuilding it in {cache_dir}")
        return None

    def _build(self, seed: int) -> dict[str, np.ndarray]:
        build = build_per_epoch_order if self.per_epoch_order else build_upstream_order
        return build(self.documents, self.indexed.sizes, self.num_samples, self.seq_length, seed)

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
