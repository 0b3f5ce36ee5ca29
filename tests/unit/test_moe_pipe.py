"""A pipeline stage's (hidden, keys, MoE-loss sum) output (megatron/model/moe_pipe.py), back-propagated as DeepSpeed's
pipeline engine does (each float output in tuple order): the gradients of one joint backward, in one pass."""

import pytest
import torch

from megatron.model.moe_pipe import first_stage_extras, stage_output


class _Counted(torch.autograd.Function):
    """Identity whose backward counts its calls: how many passes run through the stage."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _Counted.calls += 1
        return grad


def _stage(w: torch.Tensor, x: torch.Tensor, moe_in: torch.Tensor):
    """A stage: hidden = tanh(x W) through the counted node; the MoE sum adds a gate-like loss of hidden."""
    hidden = _Counted.apply(torch.tanh(x @ w))  # [s * b, h]
    return hidden * 2.0, moe_in + torch.softmax(hidden, dim=-1).pow(2).mean()


def _engine_backward(outputs, grads):
    """DeepSpeed 0.19 PipelineEngine._exec_backward_pass on a tuple: float outputs in order, retain_graph but last."""
    floats = [t for t in outputs if t.is_floating_point()]
    for i, (out, grad) in enumerate(zip(floats, grads, strict=True)):
        out.backward(gradient=grad, retain_graph=i < len(floats) - 1)


def test_stage_output_runs_one_backward_with_both_gradients():
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x, moe_in = torch.randn(6, 8, requires_grad=True), torch.tensor([0.25], requires_grad=True)
    g_hidden, g_moe = torch.randn(6, 8), torch.tensor([0.1])
    keys = torch.arange(6, dtype=torch.int64)

    hidden, moe = _stage(w, x, moe_in)
    torch.autograd.backward([hidden, moe], [g_hidden, g_moe])  # the reference: one joint backward
    want = [t.grad.clone() for t in (w, x, moe_in)]
    for t in (w, x, moe_in):
        t.grad = None

    _Counted.calls = 0
    hidden, moe = _stage(w, x, moe_in)
    sent = stage_output((hidden, keys, moe))
    assert torch.equal(sent[0], hidden) and sent[1] is keys and torch.equal(sent[2], moe)  # the values sent
    _engine_backward(sent, [g_hidden, g_moe])
    assert _Counted.calls == 1, f"{_Counted.calls} backward passes through the stage"
    for got, expected in zip((w.grad, x.grad, moe_in.grad), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)


def test_the_wrong_order_is_an_error_not_a_lost_gradient():
    w = torch.randn(4, 4, requires_grad=True)
    hidden, moe = _stage(w, torch.randn(3, 4), torch.zeros(1))
    sent = stage_output((hidden, moe))
    with pytest.raises(RuntimeError, match="before the hidden state"):
        sent[1].backward(torch.ones(1))


def test_first_stage_extras_and_evaluation_pass_through():
    keys = torch.arange(6, dtype=torch.int64).view(3, 2)
    k, moe = first_stage_extras(keys)
    assert k is keys and moe.dtype == torch.float32 and moe.shape == (1,) and moe.item() == 0.0
    with torch.no_grad():
        out = (torch.ones(2), keys, moe)
        assert stage_output(out) is out


def test_the_last_stages_loss_adds_the_moe_loss_in_training_only():
    """GPTModelPipe's loss_fn with experts: lm + coeff x sum in training (what is back-propagated), the lm loss alone in
    evaluation (as the plain path), both parts kept for the engine's additional losses."""
    from megatron.core.parallel_state import single_process_state
    from megatron.model.gpt_model_pipe import LMLoss

    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))  # [b, s, V], [b, s]
    mask = torch.ones(2, 5)
    dense = LMLoss(single_process_state())(logits, (labels, mask))
    loss = LMLoss(single_process_state(), moe_loss_coeff=0.1)
    moe_sum = torch.tensor([0.5], requires_grad=True)
    total = loss((logits, moe_sum), (labels, mask))
    assert total.shape == () and torch.allclose(total, dense + 0.05)
    assert torch.equal(loss.last["lm loss"], dense) and torch.allclose(loss.last["moe loss"], torch.tensor(0.05))
    total.backward()
    assert moe_sum.grad.item() == pytest.approx(0.1)
    loss.training = False
    assert torch.equal(loss((logits, moe_sum), (labels, mask)), dense)
