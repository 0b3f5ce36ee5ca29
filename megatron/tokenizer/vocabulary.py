"""What a training run needs of its tokenizer: the vocabulary size (before padding) and the end-of-document token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Vocabulary(Protocol):
    """Every tokenizer of tokenizer.py is one; so is ``FixedVocabulary``."""

    vocab_size: int
    eod: int | None
    """None: the data has no documents (e.g. --mock-data), so --eod-mask-loss has nothing to mask."""


@dataclass(frozen=True)
class FixedVocabulary:
    """The vocabulary of data that is already token ids (--mock-data, --demo-corpus): a size and an end-of-document
    token."""

    vocab_size: int
    eod: int | None
