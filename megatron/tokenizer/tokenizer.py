"""Tokenizers selected by Megatron's --tokenizer-type; each exposes vocab_size, eod, tokenize and detokenize.

All of them load from local files only: nothing here reaches the network.
"""

from __future__ import annotations

import os

from megatron.errors import ConfigError, DataError

# Names a tokenizer may give its end-of-document token, in the order we prefer them.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
# Beginning-of-sequence tokens (written to an HF export's config); GPT-2 has none and uses its EOD for both.
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")


class MegatronTokenizer:
    """Interface the data pipeline relies on."""

    vocab_size: int

    @property
    def eod(self) -> int:
        raise NotImplementedError

    @property
    def bos(self) -> int | None:
        """Beginning-of-sequence id, or None when the tokenizer has none (only HF export uses it)."""
        return None

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids: list[int]) -> str:
        raise NotImplementedError


class _RustTokenizer(MegatronTokenizer):
    """Shared body for tokenizers backed by a ``tokenizers.Tokenizer``."""

    def __init__(self, tok, source: str) -> None:
        self._tok = tok
        self._source = source
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        vocab = tok.get_vocab(with_added_tokens=True)
        self._eod = next((vocab[t] for t in EOD_CANDIDATES if t in vocab), None)
        self._bos = next((vocab[t] for t in BOS_CANDIDATES if t in vocab), None)
        if self._bos is None and "<|endoftext|>" in vocab:
            self._bos = vocab["<|endoftext|>"]  # GPT-2's convention: bos = eos = <|endoftext|>

    @property
    def eod(self) -> int:
        if self._eod is None:
            raise ConfigError(
                f"tokenizer {self._source} has no end-of-document token (looked for {', '.join(EOD_CANDIDATES)}); "
                f"add one when training it (tools/train_tokenizer.py does) or drop --append-eod"
            )
        return self._eod

    @property
    def bos(self) -> int | None:
        return self._bos

    def tokenize(self, text: str) -> list[int]:
        # No BOS/EOS insertion: Megatron appends EOD itself (--append-eod), documents are otherwise raw.
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class GPT2BPETokenizer(_RustTokenizer):
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt`` (--vocab-file, --merge-file)."""

    def __init__(self, vocab_file: str | None, merge_file: str | None) -> None:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        files = (("--vocab-file", vocab_file), ("--merge-file", merge_file))
        for flag, path in files:
            if not path:
                raise ConfigError(f"--tokenizer-type GPT2BPETokenizer needs {flag} (vocab.json / merges.txt)")
        for flag, path in files:
            if not os.path.isfile(path):
                raise ConfigError(f"{flag} {path} not found; make one with tools/train_tokenizer.py")
        try:
            tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        except Exception as e:  # noqa: BLE001 - the Rust loader raises a bare Exception on a malformed file
            raise DataError(f"cannot read GPT-2 BPE files {vocab_file} / {merge_file}: {e}") from None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        vocab = tok.get_vocab()
        # Treat the EOD string as one token in text too, as HF's GPT-2 tokenizer does.
        tok.add_special_tokens([AddedToken(t, special=True) for t in EOD_CANDIDATES if t in vocab])
        super().__init__(tok, vocab_file)


class HFTokenizer(MegatronTokenizer):
    """A local Hugging Face tokenizer: a ``tokenizer.json`` file or a directory (--tokenizer-model)."""

    def __init__(self, tokenizer_model: str | None) -> None:
        if not tokenizer_model:
            raise ConfigError("--tokenizer-type HFTokenizer needs --tokenizer-model (a directory or tokenizer.json)")
        if not os.path.exists(tokenizer_model):
            raise ConfigError(f"--tokenizer-model {tokenizer_model} not found; make one with tools/train_tokenizer.py")
        json_path = tokenizer_model
        if os.path.isdir(tokenizer_model):
            json_path = os.path.join(tokenizer_model, "tokenizer.json")
        if os.path.isfile(json_path):
            from tokenizers import Tokenizer

            try:
                self._impl: MegatronTokenizer = _RustTokenizer(Tokenizer.from_file(json_path), json_path)
            except Exception as e:  # noqa: BLE001 - the Rust side raises a bare Exception on a malformed file
                raise DataError(f"cannot read tokenizer {json_path}: {e}") from None
        else:
            self._impl = _TransformersTokenizer(tokenizer_model)
        self.vocab_size = self._impl.vocab_size

    @property
    def eod(self) -> int:
        return self._impl.eod

    @property
    def bos(self) -> int | None:
        return self._impl.bos

    def tokenize(self, text: str) -> list[int]:
        return self._impl.tokenize(text)

    def detokenize(self, ids: list[int]) -> str:
        return self._impl.detokenize(ids)


class _TransformersTokenizer(MegatronTokenizer):
    """A directory transformers can load offline but that has no tokenizer.json (e.g. a slow tokenizer)."""

    def __init__(self, directory: str) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as e:
            raise DataError(f"cannot load a tokenizer from --tokenizer-model {directory}: {e}") from None
        self.vocab_size = len(self._tok)
        self._source = directory

    @property
    def eod(self) -> int:
        if self._tok.eos_token_id is None:
            raise ConfigError(f"tokenizer {self._source} has no eos token; set one in its config or drop --append-eod")
        return self._tok.eos_token_id

    @property
    def bos(self) -> int | None:
        return self._tok.bos_token_id

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))


class SentencePieceTokenizer(MegatronTokenizer):
    """A SentencePiece ``.model`` file (--tokenizer-model); needs the optional sentencepiece package."""

    def __init__(self, tokenizer_model: str | None) -> None:
        if not tokenizer_model or not os.path.isfile(tokenizer_model):
            raise ConfigError(f"--tokenizer-model {tokenizer_model} is not a SentencePiece .model file")
        try:
            import sentencepiece
        except ImportError:
            raise ConfigError("--tokenizer-type SentencePieceTokenizer needs `pip install sentencepiece`") from None
        self._sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
        self.vocab_size = self._sp.get_piece_size()
        self._eod = self._sp.eos_id()
        self._bos = self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int | None:
        return self._bos

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode(list(ids))


class NullTokenizer(MegatronTokenizer):
    """Text is already whitespace-separated ids (Megatron's NullTokenizer); eod is the extra id ``vocab_size``."""

    def __init__(self, vocab_size: int | None) -> None:
        if not vocab_size or vocab_size <= 0:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size N (a positive integer)")
        self._eod = vocab_size
        self.vocab_size = vocab_size + 1

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(t) for t in text.split()]
        except ValueError:
            raise DataError(f"NullTokenizer expects whitespace-separated integers, got {text[:40]!r}") from None
        if any(i < 0 or i >= self._eod for i in ids):
            raise DataError(f"NullTokenizer: an id in {text[:40]!r} is outside [0, {self._eod})")
        return ids

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


TOKENIZER_TYPES = ("GPT2BPETokenizer", "HFTokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "NullTokenizer")


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
) -> MegatronTokenizer:
    """The tokenizer named by --tokenizer-type, from local files."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in ("HFTokenizer", "HuggingFaceTokenizer"):  # the second is Megatron-LM's spelling
        return HFTokenizer(tokenizer_model)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ConfigError(f"--tokenizer-type {tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}")
