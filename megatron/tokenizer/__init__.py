"""Tokenizers for Megatron-Frontier: ``build_tokenizer(--tokenizer-type, ...)`` and the classes it returns."""

from megatron.tokenizer.tokenizer import (
    TOKENIZER_TYPES,
    GPT2BPETokenizer,
    HFTokenizer,
    MegatronTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
)

__all__ = [
    "TOKENIZER_TYPES",
    "GPT2BPETokenizer",
    "HFTokenizer",
    "MegatronTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "build_tokenizer",
]
