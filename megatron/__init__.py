"""Megatron-Frontier: a Megatron-DeepSpeed-style GPT trainer tuned for Frontier's MI250X GCDs."""

__version__ = "0.1.0"
