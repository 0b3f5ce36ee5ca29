"""The bos/eos ids an HF export writes into config.json: from an imported HF model (kept in its full state),
else from the tokenizer the checkpoint was trained with (its saved flags) or the exporter's own flags."""

from __future__ import annotations

import json
import os

from megatron.checkpointing.full_state.files import FULL_STATE_META, is_full_state
from megatron.checkpointing.live.markers import META, read_latest, read_meta
from megatron.errors import MegatronError
from megatron.tokenizer import build_tokenizer

TOKENIZER_FLAGS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size")


def tokenizer_special_ids(flags: dict) -> dict:
    """{bos_token_id, eos_token_id} of the tokenizer ``flags`` (plain --tokenizer-* values) name; {} when none
    is named or its files are gone (an export still works, without the ids)."""

    if not flags.get("tokenizer_type"):
        return {}
    try:
        tok = build_tokenizer(flags["tokenizer_type"], vocab_file=flags.get("vocab_file"),
                              merge_file=flags.get("merge_file"), tokenizer_model=flags.get("tokenizer_model"),
                              vocab_size=flags.get("vocab_size"))
        eos = tok.eod
    except MegatronError:
        return {}
    out = {"eos_token_id": int(eos)}
    if tok.bos is not None:
        out["bos_token_id"] = int(tok.bos)
    return out


def special_ids_of_checkpoint(path: str, tag: str | None, override: dict | None = None) -> dict:
    """The ids for an export of ``path`` (a --save directory, one tag directory or a full state).
    ``override``: tokenizer flags given to the exporter, which win over what the checkpoint recorded."""

    if override and override.get("tokenizer_type"):
        return tokenizer_special_ids(override)
    if is_full_state(path):
        with open(os.path.join(path, FULL_STATE_META)) as f:
            meta = json.load(f)
        return dict(meta.get("special_tokens") or tokenizer_special_ids(meta.get("args") or {}))
    if tag is None and not os.path.isfile(os.path.join(path, META)):
        tag = read_latest(path)
    meta = read_meta(os.path.join(path, tag) if tag else path)
    return tokenizer_special_ids({k: meta.get("args", {}).get(k) for k in TOKENIZER_FLAGS})
