"""``--mock-data``: deterministic synthetic tokens, no files (as Megatron-LM's mock dataset).

Sample ``i`` depends only on (seed, i), so every layout (TP/PP/DP) sees exactly the same data and
loss curves compare across layouts.
"""

from __future__ import annotations

import numpy as np


class MockGPTDataset:
    """Each sample is an arithmetic progression modulo the vocab with a random start and stride:
    learnable (the loss falls), so equivalence tests compare a moving loss, not a flat one."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 1234) -> None:
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        rng = np.random.default_rng([self.seed, idx])
        start, stride = rng.integers(0, self.vocab_size), rng.integers(1, 8)
        return {"text": (start + stride * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size}
