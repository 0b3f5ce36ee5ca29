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


def _load_sentencepiece(tokenizer_type: str, tokenizer_model: str | None):
    """A SentencePieceProcessor for --tokenizer-model, or one line naming the flag / file / package."""
    if not tokenizer_model:
        raise ConfigError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model (a SentencePiece .model file; "
                          "tools/train_tokenizer.py --format sentencepiece makes one)")
    if not os.path.isfile(tokenizer_model):
        raise ConfigError(f"--tokenizer-model {tokenizer_model} not found (--tokenizer-type {tokenizer_type} needs a "
                          "SentencePiece .model file)")
    try:
        import sentencepiece
    except ImportError:
        raise ConfigError(f"--tokenizer-type {tokenizer_type} needs the sentencepiece package: "
                          "pip install sentencepiece") from None
    try:
        return sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
    except (OSError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"--tokenizer-model {tokenizer_model} is not a SentencePiece model ({first})") from None


class GPTSentencePieceTokenizer(MegatronTokenizer):
    """Upstream's GPTSentencePieceTokenizer (its Llama scripts): the model's own pieces and ids, nothing added.

    vocab_size is the model's piece count; bos / eos / pad are the model's ids (-1 when it has none); the
    end-of-document token is eos; tokenize adds no bos or eos (--append-eod adds the eos)."""

    name = "GPTSentencePieceTokenizer"

    def __init__(self, tokenizer_model: str | None) -> None:
        self._sp = _load_sentencepiece(self.name, tokenizer_model)
        self._source = tokenizer_model
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id, self.eos_id, self.pad_id = self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()

    @property
    def eod(self) -> int:
        if self.eos_id < 0:
            raise ConfigError(f"SentencePiece model {self._source} has no eos piece (eos_id -1): retrain it with an "
                              "eos piece or drop --append-eod")
        return self.eos_id

    @property
    def bos(self) -> int | None:
        return self.bos_id if self.bos_id >= 0 else None

    @property
    def pad(self) -> int:
        return self.pad_id

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode_as_ids(text)

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode_ids(list(ids))


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron-LM's Llama2Tokenizer: as GPTSentencePieceTokenizer, but every document starts with bos (text
    completion, as Llama-2 was trained); eos is appended only on request (--append-eod does it)."""

    name = "Llama2Tokenizer"

    def __init__(self, tokenizer_model: str | None) -> None:
        super().__init__(tokenizer_model)
        if self.bos_id < 0:
            raise ConfigError(f"--tokenizer-type Llama2Tokenizer: SentencePiece model {tokenizer_model} has no bos "
                              "piece (bos_id -1); use GPTSentencePieceTokenizer or retrain it with one")

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = self._sp.encode(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eod] if eos else [])


class SentencePieceTokenizer(MegatronTokenizer):
    """Upstream's SentencePieceTokenizer (its BERT/T5 one): the model's pieces plus <CLS>, <SEP>, <EOD>, <MASK>
    and, when the model lacks them, <PAD>/<BOS>/<EOS>, appended after the last piece in that order.

    The end-of-document token is the added <EOD> (not eos), so vocab_size is the piece count plus the added
    tokens, and the special tokens' text in a document becomes their single id, as upstream does."""

    def __init__(self, tokenizer_model: str | None) -> None:
        self._sp = _load_sentencepiece("SentencePieceTokenizer", tokenizer_model)
        n = self._sp.get_piece_size()
        self._vocab = {self._sp.id_to_piece(i): i for i in range(n)}
        self._special: dict[str, int] = {}  # in the order they were added: ties in tokenize go to the earlier

        def add(token: str) -> int:
            self._special[token] = self._vocab.setdefault(token, len(self._vocab))
            return self._special[token]

        self._cls, self._sep, self._eod, self._mask = (add(t) for t in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"))
        ids = {}
        for kind, model_id in (("pad", self._sp.pad_id()), ("bos", self._sp.bos_id()), ("eos", self._sp.eos_id())):
            ids[kind] = add(self._sp.id_to_piece(model_id) if 0 <= model_id < n else f"<{kind.upper()}>")
        self._pad, self._bos, self._eos = ids["pad"], ids["bos"], ids["eos"]
        self._inv_special = {i: t for t, i in self._special.items()}
        self.vocab_size = len(self._vocab)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int | None:
        return self._bos

    @property
    def pad(self) -> int:
        return self._pad

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        while True:
            hits = [(text.find(t, pos), order, t) for order, t in enumerate(self._special)]
            hits = [h for h in hits if h[0] >= 0]
            if not hits:
                break
            at, _, token = min(hits)  # the earliest occurrence; the first-added token on a tie
            ids += self._sp.encode_as_ids(text[pos:at]) + [self._special[token]]
            pos = at + len(token)
        return ids + self._sp.encode_as_ids(text[pos:])

    def detokenize(self, ids: list[int]) -> str:
        # Upstream's spacing: each special token is written with a space on either side of it.
        out, run = "", []
        for i in ids:
            if i in self._inv_special:
                out += self._sp.decode_ids(run) + " " + self._inv_special[i] + " "
                run = []
            else:
                run.append(i)
        return out + self._sp.decode_ids(run)


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


TOKENIZER_TYPES = ("GPT2BPETokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "SentencePieceTokenizer",
                   "HFTokenizer", "HuggingFaceTokenizer", "NullTokenizer")
DEFAULT_TOKENIZER_TYPE = "GPT2BPETokenizer"
"""Upstream's pretrain_gpt.py default (its args_defaults), which the Frontier job scripts rely on."""


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
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ConfigError(f"--tokenizer-type {tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}")
