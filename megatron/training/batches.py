"""Micro-batches for one DP rank, resumable from a consumed-samples count.

Global batch k holds samples [k*GBS, (k+1)*GBS) whatever the layout; within each step of
``micro_batch_size * DP`` samples, DP rank d takes a contiguous block of ``micro_batch_size``
(Megatron's MegatronPretrainingSampler order, see megatron/data/samplers.py). So DP=1 and DP=n
train on the same global batches, and TP peers load the same samples. ``dataloader_type="cyclic"`` is upstream's
random order, and its stream goes on over epochs as upstream's ``cyclic_iter`` does.
"""

from __future__ import annotations

from collections.abc import Iterator

from deepspeed.accelerator import get_accelerator

from megatron.data.gpt_builder import build_data_loader


def eod_loss_mask(batches: Iterator[dict], eod: int) -> Iterator[dict]:
    """--eod-mask-loss, as upstream's get_ltor_masks_and_position_ids: no loss where the *input* token is the
    end-of-document token (the prediction of the next document's first token). ``loss_mask`` [b, s] goes
    through the pipeline batches and the Ulysses slices with the tokens."""
    for batch in batches:
        yield {**batch, "loss_mask": (batch["text"][:, :-1] != eod).float()}


def microbatches(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 device: str | None = None, num_workers: int = 0, dataloader_type: str = "single",
                 seed: int = 0, data_sharding: bool = True) -> Iterator[dict]:
    device = device or get_accelerator().current_device_name()
    loader = build_data_loader(dataset, consumed_samples, micro_batch_size, dp_rank, dp_size, num_workers,
                               dataloader_type, seed, data_sharding)
    while True:
        for batch in loader:
            yield {k: v.to(device) for k, v in batch.items()}
        if dataloader_type != "cyclic":  # single: one pass; cyclic: the sampler has moved on to the next epoch
            return
