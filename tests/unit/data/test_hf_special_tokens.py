"""An HF export writes bos/eos ids when the run's tokenizer has them (issue 13, item 5): read from the
tokenizer flags a checkpoint recorded, or given to the exporter."""

import json
import os

from megatron.checkpointing.hf.tokens import special_ids_of_checkpoint, tokenizer_special_ids
from megatron.tokenizer import build_tokenizer


def test_ids_from_the_recorded_tokenizer(tokenizer_dir, tmp_path):
    flags = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": os.path.join(tokenizer_dir, "vocab.json"),
             "merge_file": os.path.join(tokenizer_dir, "merges.txt")}
    with open(flags["vocab_file"]) as f:
        eod = json.load(f)["<|endoftext|>"]  # the reference: the vocabulary file itself
    assert build_tokenizer(**flags).eod == eod
    assert tokenizer_special_ids(flags) == {"bos_token_id": eod, "eos_token_id": eod}  # GPT-2: bos = eos

    # A --save directory whose run used that tokenizer; the exporter's own flags win; none known: no ids.
    (tmp_path / "global_step3").mkdir()
    (tmp_path / "latest").write_text("global_step3")
    (tmp_path / "global_step3" / "megatron_meta.json").write_text(json.dumps({"args": flags}))
    assert special_ids_of_checkpoint(str(tmp_path), None) == {"bos_token_id": eod, "eos_token_id": eod}
    null = {"tokenizer_type": "NullTokenizer", "vocab_size": 100}
    assert special_ids_of_checkpoint(str(tmp_path), None, null) == {"eos_token_id": 100}
    (tmp_path / "global_step3" / "megatron_meta.json").write_text(json.dumps({"args": {"mock_data": True}}))
    assert special_ids_of_checkpoint(str(tmp_path), "global_step3") == {}
