"""Where the tokens come from: Megatron .bin/.idx files (one set cut by --split, or one per split) with their
tokenizer, synthetic tokens or the embedded demo corpus; the split, the sample order and the loader."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.errors import ConfigError
from megatron.flag_bounds import check_fields


@dataclass(frozen=True)
class DataConfig:
    data_path: tuple[str, ...] | None = None
    """PREFIX, or W1 PREFIX1 W2 PREFIX2 ... to blend (megatron/data/gpt_builder.py parses it)."""
    train_data_path: tuple[str, ...] | None = None
    """--train-data-path: the train split's own corpora, in --data-path's form (upstream's per-split paths)."""
    valid_data_path: tuple[str, ...] | None = None
    test_data_path: tuple[str, ...] | None = None
    mock_data: bool = False
    demo_corpus: bool = False
    vocab_size: int | None = None
    """--vocab-size: the vocabulary of --mock-data (and of the NullTokenizer)."""
    split: str = "969,30,1"
    data_cache_path: str | None = None
    tokenizer_type: str | None = None
    """With --data-path and no --tokenizer-type: upstream's default, GPT2BPETokenizer (set by the parser)."""
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    dataloader_type: str = "single"
    """single: samples in index order; cyclic: upstream's random order per epoch (seeded by the epoch)."""
    data_sharding: bool = True
    """--dataloader-type cyclic: each DP rank permutes its own contiguous share (False: --no-data-sharding)."""
    num_workers: int = 0
    eod_mask_loss: bool = False
    """No loss on the prediction after an end-of-document token (upstream's --eod-mask-loss)."""
    per_epoch_doc_shuffle: bool = False
    """NOT upstream's order: each epoch's documents shuffled on their own (this project's order before upstream's)."""

    def split_paths(self) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None, tuple[str, ...] | None]:
        """(--train-data-path, --valid-data-path, --test-data-path)."""
        return self.train_data_path, self.valid_data_path, self.test_data_path

    @property
    def per_split(self) -> bool:
        """The data comes from per-split paths (--train/--valid/--test-data-path), not --data-path and --split."""
        return any(p is not None for p in self.split_paths())

    @property
    def files(self) -> bool:
        """The data comes from .bin/.idx files (--data-path or the per-split paths)."""
        return bool(self.data_path) or self.per_split

    def sources(self) -> list[str]:
        return [flag for flag, on in (("--data-path", self.data_path), ("--train-data-path", self.per_split),
                                      ("--mock-data", self.mock_data), ("--demo-corpus", self.demo_corpus)) if on]

    def source(self) -> str:
        """The one data source: '--data-path', '--train-data-path' (with or without --valid/--test-data-path),
        '--mock-data' or '--demo-corpus'; a run without one is refused here
        (a dry run or a tool may build a config without data)."""
        sources = self.sources()
        if not sources:
            raise ConfigError("no data source: pass --data-path PREFIX (with --vocab-file/--merge-file, or "
                              "--tokenizer-type and its files), --mock-data --vocab-size N, or --demo-corpus")
        return sources[0]

    def validate(self) -> DataConfig:
        check_fields(self, {"vocab_size": "--vocab-size", "num_workers": "--num-workers"})
        sources = self.sources()
        if self.data_path and self.per_split:
            given = next(f for f, p in zip(("--train-data-path", "--valid-data-path", "--test-data-path"),
                                           self.split_paths(), strict=True) if p is not None)
            raise ConfigError(f"--data-path and {given} are both given: upstream reads --data-path and silently "
                              "ignores the per-split paths; give one (--data-path with --split, or the per-split "
                              "paths)")
        if len(sources) > 1:
            raise ConfigError(f"{' and '.join(sources)} are all set: pick one data source")
        if self.eod_mask_loss and self.mock_data:
            raise ConfigError("--eod-mask-loss needs data made of documents with an end-of-document token: use "
                              "--data-path with its tokenizer (or --demo-corpus); --mock-data has none")
        if self.dataloader_type not in ("single", "cyclic"):
            raise ConfigError(f"--dataloader-type {self.dataloader_type!r}: choose single or cyclic")
        return self
