"""Reuse of index caches written by upstream Megatron-DeepSpeed (``<md5>.dsc``, ``<md5>_doc_idx.npy``,
``<md5>_sample_idx.npy``, ``<md5>_shuffle_idx.npy``), which take minutes to build for a large corpus.

Upstream names the files by the md5 of a short text description (prefix as given on the command line, split name,
sample count, epochs, sequence length, seed, --split string) and looks for them in ``dirname(prefix)/index-cache``,
then in --data-cache-path. That description says nothing of the data itself, so a cache that matches it is still
checked against the documents before use (streaming O(samples) passes, no shuffle): doc_idx and shuffle_idx hold the
right values in the right parts (bounds and sums), and every sample starts at its token position given the sizes.
Anything off is one log line and our own build; an upstream file is never written to.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import numpy as np

from megatron.data.index_build import samples_in, separate_last_epoch
from megatron.data.split import parse_split

UPSTREAM_KEYS = {"doc_idx": "_doc_idx.npy", "sample_idx": "_sample_idx.npy", "shuffle_idx": "_shuffle_idx.npy"}
_CHUNK = 1 << 22  # rows checked at a time, so the check of a billion-sample index stays within a few hundred MB


def upstream_description(prefix: str, name: str, num_samples: int, epochs: int, seq_length: int, seed: int,
                         split: str) -> str:
    """The text upstream hashes into its cache file names (its GPTDataset description)."""
    return (f"GPT Dataset\n\nData prefix {prefix}\nDataset name {name}\nNumber of samples {num_samples}\n"
            f"Number of epochs {epochs}\nSequence length {seq_length}\nRandom seed {seed}\nSplit {split}\n")


def upstream_dirs(prefix: str, data_cache_path: str | None) -> list[str]:
    """Where upstream would have written its cache, in its search order."""
    dirs = [os.path.join(os.path.dirname(prefix), "index-cache")]
    return dirs + ([data_cache_path] if data_cache_path else [])


def split_spellings(split: str) -> list[str]:
    """--split strings upstream may have hashed for this split: as given, and upstream's default spelling
    "969, 30, 1" (with spaces) when the proportions are the default ones, for a run that never passed --split."""
    return [split] + ([UPSTREAM_DEFAULT_SPLIT] if split != UPSTREAM_DEFAULT_SPLIT
                      and parse_split(split) == parse_split(UPSTREAM_DEFAULT_SPLIT) else [])


UPSTREAM_DEFAULT_SPLIT = "969, 30, 1"


def find_upstream(prefix: str, data_cache_path: str | None, descriptions: list[str]
                  ) -> tuple[dict[str, str] | None, str]:
    """(paths of a complete upstream cache whose .dsc holds exactly one of ``descriptions``, "") or (None, why not:
    empty when there is no candidate at all)."""
    for description in descriptions:
        paths, why = _find_one(prefix, data_cache_path, description)
        if paths is not None or why:
            return paths, why
    return None, ""


def _find_one(prefix: str, data_cache_path: str | None, description: str) -> tuple[dict[str, str] | None, str]:
    digest = hashlib.md5(description.encode("utf-8")).hexdigest()
    for d in upstream_dirs(prefix, data_cache_path):
        dsc = os.path.join(d, digest + ".dsc")
        paths = {k: os.path.join(d, digest + suffix) for k, suffix in UPSTREAM_KEYS.items()}
        if not all(os.path.isfile(p) for p in [dsc, *paths.values()]):
            continue
        try:
            with open(dsc, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            return None, f"{dsc} unreadable ({e})"
        if text != description:
            return None, f"{dsc} describes another data set"
        return paths, ""
    return None, ""


def check_upstream_arrays(arrays: dict[str, np.ndarray], documents: np.ndarray, sizes: np.ndarray,
                          num_samples: int, seq_length: int, epochs: int) -> str:
    """"" when the arrays are a valid index of these documents for this run, else what is wrong (one phrase)."""
    doc_idx, sample_idx, shuffle_idx = arrays["doc_idx"], arrays["sample_idx"], arrays["shuffle_idx"]
    n_docs, begin = len(documents), int(documents[0])
    tokens_per_epoch = int(sizes[documents].astype(np.int64).sum())
    total = samples_in(epochs, tokens_per_epoch, seq_length)
    separate = separate_last_epoch(epochs, tokens_per_epoch, seq_length, num_samples)
    if doc_idx.ndim != 1 or len(doc_idx) != epochs * n_docs:
        return f"doc_idx holds {len(doc_idx)} entries, not {epochs} epochs x {n_docs} documents"
    cut = (epochs - 1) * n_docs if separate else 0
    for lo, hi in ((0, cut), (cut, epochs * n_docs)):  # each part: whole epochs of this split's documents
        times = (hi - lo) // n_docs
        if not _holds(doc_idx, lo, hi, begin, begin + n_docs, times * ((2 * begin + n_docs - 1) * n_docs // 2)):
            return "doc_idx does not hold the documents of this split once per epoch"
    if sample_idx.shape != (total + 1, 2):
        return f"sample_idx has shape {sample_idx.shape}, not ({total + 1}, 2)"
    if why := _check_sample_starts(doc_idx, sample_idx, sizes, seq_length):
        return why
    if len(shuffle_idx) != total:
        return f"shuffle_idx holds {len(shuffle_idx)} samples, not {total}"
    first = samples_in(epochs - 1, tokens_per_epoch, seq_length) if separate else total
    for lo, hi in ((0, first), (first, total)):
        if not _holds(shuffle_idx, lo, hi, lo, hi, (hi * (hi - 1) - lo * (lo - 1)) // 2):
            return "shuffle_idx is not a shuffle of the samples in upstream's parts"
    return ""


def _holds(array: np.ndarray, lo: int, hi: int, low: int, high: int, total: int) -> bool:
    """array[lo:hi] holds values in [low, high) that sum to ``total``: streaming passes only (no scatter, no copy of
    the whole). Upstream's files are shuffles by construction and their order follows from the seed, so bounds and
    sums are enough to tell a file of another split, epoch count or run, or a damaged one."""
    seen = 0
    for start in range(lo, hi, _CHUNK):
        chunk = np.asarray(array[start: min(hi, start + _CHUNK)])
        if chunk.min() < low or chunk.max() >= high:
            return False
        seen += int(chunk.sum(dtype=np.int64))
    return seen == total


def _check_sample_starts(doc_idx: np.ndarray, sample_idx: np.ndarray, sizes: np.ndarray, seq_length: int) -> str:
    """Sample i must start at token i * seq_length of the doc_idx-ordered stream, inside a document (chunked walk:
    sample_idx[:, 0] never decreases, so each chunk needs the prefix sums of its own documents only)."""
    base_pos, base_tokens = 0, 0  # tokens before doc_idx position base_pos
    for lo in range(0, len(sample_idx), _CHUNK):
        rows = np.asarray(sample_idx[lo: lo + _CHUNK], dtype=np.int64)
        pos, off = rows[:, 0], rows[:, 1]
        if pos[0] < base_pos or np.any(np.diff(pos) < 0) or pos[-1] >= len(doc_idx):
            return "sample_idx document positions are out of order or out of range"
        base_tokens += int(sizes[np.asarray(doc_idx[base_pos: pos[0]])].astype(np.int64).sum())
        base_pos = int(pos[0])
        lengths = sizes[np.asarray(doc_idx[base_pos: pos[-1] + 1])].astype(np.int64)
        before = base_tokens + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        local = pos - base_pos
        if np.any(before[local] + off != np.arange(lo, lo + len(rows), dtype=np.int64) * seq_length):
            return "sample_idx does not match the document sizes (another .idx, or other documents)"
        if np.any((off < 0) | ((off >= lengths[local]) & (np.arange(lo, lo + len(rows)) > 0))):
            return "sample_idx points past the end of a document"
    return ""


def load_upstream(paths: dict[str, str], check: Callable[[dict[str, np.ndarray]], str]) -> tuple[dict | None, str]:
    """(memory-mapped arrays, "") or (None, why they cannot be used)."""
    try:
        arrays = {k: np.load(p, mmap_mode="r", allow_pickle=False) for k, p in paths.items()}
    except (OSError, ValueError) as e:
        return None, f"unreadable ({e})"
    why = check(arrays)
    return (None, why) if why else (arrays, "")
