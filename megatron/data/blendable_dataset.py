"""BlendableDataset: a weighted interleaving of datasets (``--data-path w1 p1 w2 p2 ...``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron.data.helpers import build_blending_indices
from megatron.errors import DataError


class BlendableDataset:
    """``size`` samples; sample i comes from ``datasets[dataset_index[i]]``, so every prefix of the blend
    matches the normalized weights to within one sample per dataset (deterministic, no RNG)."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int) -> None:
        if len(datasets) != len(weights):
            raise ValueError("one weight per dataset")
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / w.sum()
        self.datasets = list(datasets)
        self.size = size
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, size)
        # The GPT datasets were sized from the weights with a margin; check rather than index out of range later.
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for d, (ds, n) in enumerate(zip(self.datasets, counts, strict=True)):
            if n > len(ds):
                raise DataError(f"blend needs {n} samples from dataset {d} but it has {len(ds)}; rebuild its indices")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
