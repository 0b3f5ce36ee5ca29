"""The training-step pieces of issue 15 on CPU: fused AdamW only where a device has it (CPU numerics
unchanged), fused bias-GeLU / bias-dropout-add equal to the unfused ops, the memory-lean cross entropy
equal to the reference, and --compile wired to the layers (with a stand-in for torch.compile)."""

from __future__ import annotations

import torch

from megatron.config import OptimizerConfig
from megatron.optim import optimizer as optim


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]


def test_adamw_fused_only_off_cpu_and_cpu_update_unchanged():
    o = OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_beta2=0.95)
    assert optim.fused_supported("cuda") and not optim.fused_supported("cpu")
    ours, ref = _params(), _params()
    opt = optim.make_adamw([{"params": ours, "weight_decay": 0.1}], o, device_type="cpu")
    ref_opt = torch.optim.AdamW([{"params": ref, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    assert not opt.param_groups[0]["fused"]
    for step in range(3):
        for a, b in zip(ours, ref, strict=True):
            a.grad = b.grad = torch.full_like(a, 0.5 + step)
        opt.step()
        ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    # On an accelerator the same call asks for torch's fused kernel (not run here: no device).
    seen = {}
    real = torch.optim.AdamW
    try:
        torch.optim.AdamW = lambda params, **kw: seen.update(kw) or real(params, lr=kw["lr"])
        optim.make_adamw(_params(), o, device_type="cuda")
    finally:
        torch.optim.AdamW = real
    assert seen.get("fused") is True and seen["betas"] == (0.9, 0.95)


def test_chunked_cross_entropy_matches_torch_and_the_one_chunk_path(monkeypatch):
    from megatron.core.parallel_state import GroupInfo
    from megatron.core.tensor_parallel import cross_entropy as ce

    tp = GroupInfo([0], 0, None)
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(7, 3, 50, generator=g) * 4).requires_grad_()  # [s, b, V]
    target = torch.randint(0, 50, (7, 3), generator=g)
    gout = torch.rand(7, 3, generator=g)
    one = ce.vocab_parallel_cross_entropy(logits, target, tp)
    (grad_one,) = torch.autograd.grad(one, logits, gout)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), target.reshape(-1), reduction="none")
    torch.testing.assert_close(one, ref.view(7, 3), rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(ce, "CHUNK_ELEMENTS", 2 * 3 * 50)  # 4 chunks of 2, 2, 2, 1 positions
    assert len(ce._chunks(7, 150)) == 4
    many = ce.vocab_parallel_cross_entropy(logits, target, tp)
    (grad_many,) = torch.autograd.grad(many, logits, gout)
    assert torch.equal(many, one) and torch.equal(grad_many, grad_one)

    # bf16 logits: fp32 statistics, the gradient comes back in bf16 (never an fp32 copy of all logits).
    lb = logits.detach().bfloat16().requires_grad_()
    loss = ce.vocab_parallel_cross_entropy(lb, target, tp)
    (gb,) = torch.autograd.grad(loss, lb, gout)
    ref_b = torch.nn.functional.cross_entropy(lb.float().reshape(-1, 50), target.reshape(-1), reduction="none")
    assert loss.dtype == torch.float32 and gb.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref_b.view(7, 3), rtol=1e-5, atol=1e-5)
    lf = lb.detach().float().requires_grad_()
    torch.nn.functional.cross_entropy(lf.reshape(-1, 50), target.reshape(-1), reduction="none").backward(
        gout.reshape(-1))
    torch.testing.assert_close(gb.float(), lf.grad, rtol=1e-2, atol=1e-3)


def test_bias_gelu_and_bias_dropout_add_equal_the_unfused_ops():
    from megatron.model.fusions import bias_dropout_add, bias_gelu

    g = torch.Generator().manual_seed(4)
    y, b, r = torch.randn(6, 2, 32, generator=g), torch.randn(32, generator=g), torch.randn(6, 2, 32, generator=g)
    for form in ("none", "tanh"):  # exact erf GeLU and --openai-gelu's tanh form
        assert torch.equal(bias_gelu(y, b, form), torch.nn.functional.gelu(y + b, approximate=form))
    assert not torch.equal(bias_gelu(y, b, "none"), bias_gelu(y, b, "tanh"))
    torch.manual_seed(9)
    fused = bias_dropout_add(y, b, r, 0.3, training=True)
    torch.manual_seed(9)
    assert torch.equal(fused, r + torch.nn.functional.dropout(y + b, p=0.3, training=True))
    assert torch.equal(bias_dropout_add(y, b, r, 0.3, training=False), r + (y + b))


def _gpt_grads(fused: bool, **over):
    from megatron.core.parallel_state import GroupInfo
    from megatron.model.gpt_model import GPTModel
    from megatron.config.sizes import named_model

    cfg = named_model("debug", seq_length=16, hidden_dropout=0.1, attention_dropout=0.0, attention_backend="torch",
                      bias_gelu_fusion=fused, bias_dropout_fusion=fused, torch_compile=fused, **over)
    torch.manual_seed(0)
    model = GPTModel(cfg, tp=GroupInfo([0], 0, None), init_seed=1)
    # bias-GeLU fusion takes fc1's bias out of the matmul only under --compile (ignored on CPU, so eager here)
    fc1_skips = [m.skip_bias_add for n, m in model.named_modules() if n.endswith("dense_h_to_4h")]
    assert fc1_skips and all(s == fused for s in fc1_skips), fc1_skips
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)  # the same dropout masks in both runs
    loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


def test_fused_gpt_equals_unfused_on_cpu():
    for over in ({}, {"openai_gelu": True}):
        (l0, g0), (l1, g1) = _gpt_grads(False, **over), _gpt_grads(True, **over)
        # Bit-equal at these sizes: fc1's matmul and bias add round the same whether addmm or mm + add.
        assert torch.equal(l1, l0)
        assert all(torch.equal(g1[name], grad) for name, grad in g0.items())


def test_compile_flag_reaches_the_layers_and_is_off_on_cpu(monkeypatch):
    from megatron.arguments import model_config_from_args, parse_args
    from megatron.core.parallel_state import GroupInfo
    from megatron.model import compile as mc
    from megatron.model.gpt_model import GPTModel

    args = parse_args(["--model-size", "debug", "--compile", "--no-bias-gelu-fusion"])
    cfg = model_config_from_args(args, vocab_size=256)
    assert cfg.torch_compile and not cfg.bias_gelu_fusion and cfg.bias_dropout_fusion
    defaults = model_config_from_args(parse_args(["--model-size", "debug"]), vocab_size=256)
    assert not defaults.torch_compile and defaults.bias_gelu_fusion

    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(self))
    model = GPTModel(cfg, tp=GroupInfo([0], 0, None))  # this machine's accelerator is the CPU: stays eager
    assert compiled == []
    assert mc.compile_transformer_layers(model, True, device_type="cuda") == cfg.num_layers
    assert compiled == list(model.layers)


def test_rotary_table_is_built_once_and_unchanged():
    from megatron.model import rotary

    cos, sin = rotary.rotary_cos_sin(12, 8, 10000.0, torch.device("cpu"), torch.float32)
    again = rotary.rotary_cos_sin(12, 8, 10000.0, torch.device("cpu"), torch.float32)
    assert again[0] is cos and again[1] is sin
    fresh = rotary.rotary_cos_sin.__wrapped__(12, 8, 10000.0, torch.device("cpu"), torch.float32)
    assert torch.equal(fresh[0], cos) and torch.equal(fresh[1], sin) and not cos.requires_grad
