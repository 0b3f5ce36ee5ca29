"""Mixture of experts on DeepSpeed's pipeline engine: what a stage sends besides the hidden state, and one backward
pass per stage for its two differentiable outputs.

Between stages a model with experts sends ``(hidden [s(/tp), b, h], keys [s, b] int64, moe_sum [1] float32)``: the
tokens' random-draw keys (megatron/core/moe/draws.py, from the samples' indices in the data set, computed once on the
first stage) so every stage draws the numbers one process draws, and the running sum of the MoE layers' balancing
losses, which the last stage's loss adds (times --moe-loss-coeff) to the lm loss. The engine sends no gradient for
the int64 keys and one for each float tensor, so the balancing loss's gradient comes back into every stage's gates.
"""

from __future__ import annotations

import torch


def first_stage_extras(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [s, b], the empty balancing-loss sum [1] float32) that the embedding stage starts the tuple with."""
    return keys, torch.zeros(1, dtype=torch.float32, device=keys.device)


class _Sent:
    """The detached copy of a stage's hidden state that the engine sends (and back-propagates into first)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _OneBackward(torch.autograd.Function):
    """moe_sum -> a copy whose backward also carries the hidden state's gradient, parked on the sent copy.

    DeepSpeed's engine back-propagates a stage's float outputs one at a time, in tuple order, with retain_graph:
    hidden, then moe_sum. Both graphs run through the whole stage (the balancing loss depends on every earlier layer
    through the gates' inputs), so that is two backward passes, collectives included. Here the hidden state is sent
    as a detached leaf: its backward only stores the incoming gradient, and moe_sum's backward hands that gradient
    to the real hidden state, so the stage runs one backward pass with both."""

    @staticmethod
    def forward(ctx, moe_sum: torch.Tensor, hidden: torch.Tensor, sent: _Sent) -> torch.Tensor:
        ctx.sent = sent
        return moe_sum.clone()

    @staticmethod
    def backward(ctx, grad_sum: torch.Tensor):
        grad_hidden = ctx.sent.tensor.grad
        if grad_hidden is None:
            raise RuntimeError("the pipeline engine back-propagated the MoE loss before the hidden state (it must run "
                               "its outputs' backward in tuple order, hidden first)")
        ctx.sent.tensor.grad = None
        return grad_sum, grad_hidden, None


def stage_output(outputs: tuple) -> tuple:
    """A stage's (hidden, [keys,] moe_sum) as sent to the next stage: the same values, one backward pass."""
    hidden, *rest, moe_sum = outputs
    if not torch.is_grad_enabled():
        return outputs
    sent = hidden.detach().requires_grad_()
    return (sent, *rest, _OneBackward.apply(moe_sum, hidden, _Sent(sent)))
