"""Memory-mapped ``.bin/.idx`` token datasets, byte-compatible with Megatron-LM's MMIDIDX format.

Layout of ``PREFIX.idx`` (all little-endian): the 9-byte magic ``MMIDIDX\\x00\\x00``, version (u64, always 1),
dtype code (u8), sequence count N (u64), doc_idx count M (u64), sizes int32[N], pointers int64[N] (byte
offsets into ``PREFIX.bin``), doc_idx int64[M] (sequence index where each document starts; ends with N).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

import numpy as np

from megatron.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8

# Megatron-LM's code table (megatron/core/datasets/indexed_dataset.py: DType); codes are on disk, never renumber.
DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}

_REBUILD = "re-create it with tools/preprocess_data.py"


def best_token_dtype(vocab_size: int | None) -> type[np.number]:
    """Megatron's rule: uint16 when every id fits with margin (vocab < 65500), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


class IndexedDatasetBuilder:
    """Streams token sequences into ``PREFIX.bin`` and writes ``PREFIX.idx`` on ``finalize``."""

    def __init__(self, bin_path: str, dtype: type[np.number] = np.int32) -> None:
        if np.dtype(dtype) not in _CODE_OF:
            raise ValueError(f"dtype {dtype} has no MMIDIDX code")
        self.dtype = np.dtype(dtype)
        self._bin = open(bin_path, "wb")  # noqa: SIM115 - stays open across add_document calls
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document stored as one sequence (GPT pretraining does not split sentences)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._sizes.append(arr.size)
        self._doc_idx.append(len(self._sizes))

    def add_index(self, prefix: str) -> None:
        """Append a whole existing dataset (same dtype) by copying its .bin bytes and shifting its doc_idx."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise DataError(
                f"{index_file_path(prefix)} stores {other.dtype.name} tokens but the merged output uses "
                f"{self.dtype.name}; merge only datasets made with the same tokenizer"
            )
        base = len(self._sizes)
        self._sizes.extend(other.sizes.tolist())
        self._doc_idx.extend((other.doc_idx[1:] + base).tolist())
        with open(data_file_path(prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)

    @property
    def num_documents(self) -> int:
        return len(self._doc_idx) - 1

    def close(self) -> None:
        """Close the .bin without writing an index (used when preprocessing is abandoned)."""
        self._bin.close()

    def finalize(self, idx_path: str) -> None:
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(idx_path, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", _CODE_OF[self.dtype]))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(struct.pack("<Q", len(self._doc_idx)))
            f.write(sizes.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self._doc_idx, dtype=np.int64).tobytes(order="C"))


class IndexedDataset:
    """Read-only view of ``PREFIX.bin/.idx``; nothing is loaded beyond the index arrays (both files are mmapped).

    Every way the pair can be unusable (missing, wrong magic/version, unknown dtype, truncated) raises
    ``DataError`` here, at open time, rather than as a garbage sample hours into a run.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise DataError(
                    f"{path} not found: a dataset is named by the prefix of its PREFIX.bin and PREFIX.idx files "
                    f"(e.g. --data-path data/my-corpus_text_document); {_REBUILD}"
                )
        idx_bytes = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_BYTES)
        if len(header) < len(MAGIC) or header[: len(MAGIC)] != MAGIC:
            raise DataError(f"{idx_path} is not a Megatron MMIDIDX index (wrong magic bytes); {_REBUILD}")
        if len(header) < HEADER_BYTES:
            raise DataError(f"{idx_path} is truncated ({idx_bytes} bytes, header needs {HEADER_BYTES}); {_REBUILD}")
        (version,) = struct.unpack_from("<Q", header, len(MAGIC))
        if version != VERSION:
            raise DataError(f"{idx_path} has index version {version}, only version {VERSION} is supported; {_REBUILD}")
        code = header[len(MAGIC) + 8]
        if code not in DTYPE_CODES:
            raise DataError(f"{idx_path} has unknown dtype code {code}; {_REBUILD}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        n, m = struct.unpack_from("<QQ", header, len(MAGIC) + 9)
        need = HEADER_BYTES + 4 * n + 8 * n + 8 * m
        if idx_bytes < need:
            raise DataError(f"{idx_path} is truncated ({idx_bytes} bytes, its header promises {need}); {_REBUILD}")

        self._idx_mmap = np.memmap(idx_path, mode="r", dtype=np.uint8)
        buf = memoryview(self._idx_mmap)
        self.sizes = np.frombuffer(buf, dtype=np.int32, count=n, offset=HEADER_BYTES)
        self.pointers = np.frombuffer(buf, dtype=np.int64, count=n, offset=HEADER_BYTES + 4 * n)
        self.doc_idx = np.frombuffer(buf, dtype=np.int64, count=m, offset=HEADER_BYTES + 12 * n)

        bin_bytes = os.path.getsize(bin_path)
        expected = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if n else 0
        if bin_bytes < expected:
            raise DataError(
                f"{bin_path} is truncated: {bin_bytes} bytes but {idx_path} indexes {expected}; "
                f"the copy or the preprocessing was interrupted, {_REBUILD}"
            )
        # np.memmap refuses empty files; an empty dataset is reported by whoever needs tokens from it.
        self._bin_mmap = np.memmap(bin_path, mode="r", dtype=np.uint8) if bin_bytes else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return max(len(self.doc_idx) - 1, 0)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset+length)`` of sequence ``idx`` as a zero-copy view of the .bin file."""
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        start = int(self.pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_mmap, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def check_vocab(self, vocab_size: int | None, probe_tokens: int = 1 << 20) -> None:
        """Refuse data made with a different tokenizer: by the dtype's range and by the first ids on disk.

        Only a prefix is scanned so that the check stays O(1) on trillion-token corpora.
        """
        if vocab_size is None:
            return
        if np.issubdtype(self.dtype, np.integer) and vocab_size - 1 > np.iinfo(self.dtype).max:
            raise DataError(
                f"{index_file_path(self.prefix)} stores {self.dtype.name} token ids but the tokenizer has "
                f"{vocab_size} entries, more than {self.dtype.name} can hold: the data was made with another "
                f"tokenizer; pass the same --tokenizer-type/--vocab-file as tools/preprocess_data.py or re-run it"
            )
        count = min(probe_tokens, int(self.sizes.astype(np.int64).sum()))
        if count == 0:
            return
        top = int(np.frombuffer(self._bin_mmap, dtype=self.dtype, count=count).max())
        if top >= vocab_size:
            raise DataError(
                f"{data_file_path(self.prefix)} holds token id {top} but the tokenizer has only {vocab_size} "
                f"entries: the data was made with another tokenizer; pass the same --tokenizer-type/--vocab-file "
                f"as tools/preprocess_data.py or re-run it"
            )


def merge_datasets(prefixes: Sequence[str], output_prefix: str) -> IndexedDataset:
    """Concatenate datasets (documents kept in order) into ``output_prefix.bin/.idx``."""
    if not prefixes:
        raise DataError("no input datasets to merge")
    first = IndexedDataset(prefixes[0])
    builder = IndexedDatasetBuilder(data_file_path(output_prefix), dtype=first.dtype)
    for prefix in prefixes:
        builder.add_index(prefix)
    builder.finalize(index_file_path(output_prefix))
    return IndexedDataset(output_prefix)
