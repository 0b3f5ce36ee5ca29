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


def valid_consumed_samples(iteration: int, eval_interval: int, eval_iters: int, global_batch_size: int,
                           dataset_len: int | None = None) -> int:
    """Validation samples already read before the evaluation at ``iteration`` (a multiple of eval_interval): each
    evaluation continues where the previous one stopped, as upstream's single validation iterator does, and the
    count follows from the iteration alone, so a resumed run reads the same validation batches. A validation set
    shorter than that stream (the demo corpus: fixed size, not sized from the sample count) starts over."""
    consumed = max(0, iteration // eval_interval - 1) * eval_iters * global_batch_size
    per_eval = eval_iters * global_batch_size
    if dataset_len is not None and consumed + per_eval > dataset_len:
        usable = dataset_len // per_eval * per_eval
        return consumed % usable if usable else 0
    return consumed
