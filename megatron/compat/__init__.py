"""Compatibility with upstream Megatron-DeepSpeed job scripts: every flag and DeepSpeed JSON key is classed as
honoured, an accepted no-op, or refused up front (``ds_config_keys`` holds the DeepSpeed JSON side)."""
