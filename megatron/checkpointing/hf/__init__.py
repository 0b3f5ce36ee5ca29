"""HF transformers conversion: dense models (dense.py: GPT-2, Llama, GPT-NeoX), models with experts (moe.py: Mixtral,
Qwen2-MoE), the special tokens of an export (tokens.py) and the conversions the tools call (convert.py)."""
