"""Tokenizers for Megatron-Frontier: ``build_tokenizer(--tokenizer-type, ...)`` and the classes it returns."""

from megatron.tokenizer.tokenizer import (
    DEFAULT_TOKENIZER_TYPE,
    TOKENIZER_TYPES,
    GPT2BPETokenizer,
    GPTSentencePieceTokenizer,
    HFTokenizer,
    Llama2Tokenizer,
    MegatronTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
)
from megatron.tokenizer.vocabulary import FixedVocabulary, Vocabulary

__all__ = [
    "DEFAULT_TOKENIZER_TYPE",
    "FixedVocabulary",
    "TOKENIZER_TYPES",
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "HFTokenizer",
    "Llama2Tokenizer",
    "MegatronTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "Vocabulary",
    "build_tokenizer",
]
