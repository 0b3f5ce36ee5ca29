"""How many samples each split is asked for: the number decides how many epochs a GPT index spans, hence the order
of every sample in it, so it must be computed as upstream Megatron-DeepSpeed computes it."""

from __future__ import annotations


def train_valid_test_num_samples(train_iters: int, train_samples: int | None, global_batch_size: int,
                                 eval_interval: int, eval_iters: int) -> tuple[int, int, int]:
    """(train, valid, test) sample counts: ``--train-samples`` (or train_iters x global batch); validation is read on
    as one stream across the run's evaluations plus one more (the end of training), and test is one evaluation."""
    train = int(train_samples) if train_samples else int(train_iters) * global_batch_size
    evaluations = train_iters // eval_interval + 1 if eval_interval > 0 else 1
    return train, evaluations * eval_iters * global_batch_size, eval_iters * global_batch_size
