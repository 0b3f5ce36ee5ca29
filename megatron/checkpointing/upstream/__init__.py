"""Checkpoints written by upstream Megatron-DeepSpeed and by plain Megatron-LM, read into our full-state form and
resumed at any layout.

layout.py recognises the directories (markers, file names) and holds the records; unpickle.py loads their files
(pickled Python objects only with ``--trust-checkpoint``); mapping.py maps upstream's flags, fused-QKV order and TP
splits to ours (the parameter names: megatron/model/param_names.py); moments.py reads the Adam moments;
universal.py DeepSpeed's universal form; reader.py reads a whole checkpoint (DeepSpeed-MoE per-expert files too,
../ds_layout/files.py); resume.py checks one against a run (preflight) and is the format ``--load`` of one uses.
writer.py / writer_zero.py write a full state back in upstream's layout.
"""

from megatron.checkpointing.upstream.layout import (
    Converted,
    Found,
    describe,
    unknown_layout_message,
)
from megatron.checkpointing.upstream.mapping import qkv_to_ours
from megatron.checkpointing.upstream.reader import find, first_args, header, read
from megatron.checkpointing.upstream.resume import check_upstream, load_upstream, rng_for, vocab_rows
from megatron.checkpointing.upstream.unpickle import load_file

__all__ = ["Converted", "Found", "check_upstream", "describe", "find", "first_args", "header", "load_file",
           "load_upstream", "qkv_to_ours", "read", "rng_for", "unknown_layout_message", "vocab_rows"]
