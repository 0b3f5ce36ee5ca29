"""Micro-batches for one DP rank, resumable from a consumed-samples count.

Global batch k holds samples [k*GBS, (k+1)*GBS) whatever the layout; within each step of
``micro_batch_size * DP`` samples, DP rank d takes a contiguous block of ``micro_batch_size``
(Megatron's MegatronPretrainingSampler order). So DP=1 and DP=n train on the same global batches.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator


def microbatches(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 device: str | None = None) -> Iterator[dict]:
    device = device or get_accelerator().current_device_name()
    n = len(dataset)
    idx = consumed_samples
    while True:
        start = idx + dp_rank * micro_batch_size
        rows = [dataset[i % n] for i in range(start, start + micro_batch_size)]
        batch = {k: torch.from_numpy(np.stack([np.asarray(r[k]) for r in rows])) for k in rows[0]}
        yield {k: v.to(device) for k, v in batch.items()}
        idx += micro_batch_size * dp_size
