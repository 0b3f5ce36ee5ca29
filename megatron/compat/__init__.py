"""Compatibility with upstream Megatron-DeepSpeed job scripts, kept as data.

Every flag of upstream's pretrain_gpt.py parser (``upstream_flags.json``) and every DeepSpeed JSON key
(``ds_config_keys.py``) is in exactly one class: honoured, an accepted no-op, or refused in one line before any
process group. ``flags.py`` holds the flag side; ``tools/compat_table.py`` writes the tables of docs/compatibility.md
from both.
"""
