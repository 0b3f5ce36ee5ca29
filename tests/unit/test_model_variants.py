"""Upstream's model variants against upstream's own modules (tests/fixtures/upstream_variants, made by upstream's code
on CPU) where its CPU path runs them, else against the formula its flag names: output and every gradient."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from megatron.checkpointing.upstream.mapping import qkv_to_ours
from megatron.config import ModelConfig
from megatron.core.parallel_state import GroupInfo, single_process_state
from megatron.errors import ConfigError
from megatron.model.embedding import Embedding
from megatron.model.mlp import MLP
from megatron.model.norms import Norm
from megatron.model.transformer import TransformerLayer

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "upstream_variants")
SEQ, BATCH, HIDDEN, HEADS, FFN, VOCAB = 8, 2, 16, 2, 32, 64  # make_fixtures.py's shape


def _fixture(name: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(FIXTURES, f"{name}.safetensors"))


def _cfg(**variant) -> ModelConfig:
    fields = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN, seq_length=SEQ,
                  vocab_size=VOCAB, make_vocab_size_divisible_by=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                  attention_backend="torch")
    return ModelConfig(**{**fields, **variant})


def _load(module: torch.nn.Module, fx: dict[str, torch.Tensor], rename=lambda name, t: (name, t)) -> None:
    """The fixture's ``param.*`` into ``module`` (every parameter, none left over)."""
    params = dict(rename(k[len("param."):], v) for k, v in fx.items() if k.startswith("param."))
    missing, unexpected = module.load_state_dict(params, strict=False)
    assert not missing and not unexpected, (missing, unexpected)


def _check(module: torch.nn.Module, fx: dict[str, torch.Tensor], out: torch.Tensor, x: torch.Tensor | None,
           rename=lambda name, t: (name, t), tol: float = 1e-5) -> None:
    """Output and, after the backward of sum(out * g), the input's and every parameter's gradient within ``tol``."""
    torch.testing.assert_close(out, fx["output"], rtol=tol, atol=tol)
    (out.float() * fx["output_grad"].float()).sum().backward()
    if x is not None:
        torch.testing.assert_close(x.grad, fx["input_grad.x"], rtol=tol, atol=tol)
    grads = dict(rename(k[len("grad."):], v) for k, v in fx.items() if k.startswith("grad."))
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=tol, atol=tol, msg=name)


def _with_bias(pair: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    out, bias = pair
    return out if bias is None else out + bias


def test_squared_relu_mlp_is_upstreams():
    fx = _fixture("mlp_squared_relu")
    mlp = MLP(_cfg(squared_relu=True), 0, tp=single_process_state().tp, sequence_parallel=False, init_seed=1)
    _load(mlp, fx)
    x = fx["input.x"].clone().requires_grad_()
    _check(mlp, fx, _with_bias(mlp(x)), x)


def test_post_layernorm_residual_layer_is_upstreams():
    fx = _fixture("layer_post_ln")
    cfg = _cfg(apply_residual_connection_post_layernorm=True)
    layer = TransformerLayer(cfg, 0, tp=single_process_state().tp)

    def ours(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:  # upstream's fused QKV is [Q | K | V]
        return name, qkv_to_ours(t, HEADS, HEADS, HIDDEN // HEADS) if "query_key_value" in name else t

    _load(layer, fx, ours)
    x = fx["input.x"].clone().requires_grad_()
    _check(layer, fx, layer(x), x, ours)
    # the variant changes the arithmetic: the same weights without it give another output
    plain = TransformerLayer(_cfg(), 0, tp=single_process_state().tp)
    _load(plain, fx, ours)
    assert (plain(fx["input.x"]) - fx["output"]).abs().max() > 1e-2


def test_embedding_weights_in_fp32_is_upstreams():
    """bf16: the same output bits; the word embedding's gradient is upstream's fp32 one rounded once to bf16 (upstream
    leaves an fp32 .grad on its bf16 parameter, which DeepSpeed casts; ours arrives through the cast's backward)."""
    fx = _fixture("embedding_fp32")
    emb = Embedding(_cfg(embedding_weights_in_fp32=True), VOCAB, tp=single_process_state().tp)
    emb = emb.to(torch.bfloat16)

    def ours(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
        return name.replace("position_embeddings.weight", "position_embeddings"), t

    _load(emb, fx, ours)
    out = emb(fx["input.ids"])
    assert out.dtype == torch.bfloat16 and torch.equal(out, fx["output"])
    (out.float() * fx["output_grad"].float()).sum().backward()
    assert torch.equal(emb.position_embeddings.grad, fx["grad.position_embeddings.weight"])
    assert fx["grad.word_embeddings.weight"].dtype == torch.float32
    assert torch.equal(emb.word_embeddings.weight.grad, fx["grad.word_embeddings.weight"].bfloat16())


def test_layernorm_1p_is_upstreams_mixed_fused_layer_norm():
    fx = _fixture("layernorm_1p")
    norm = Norm(HIDDEN, "layernorm", 1e-5, one_plus=True, backend="torch")
    assert torch.equal(norm.weight.detach(), fx["initial.weight"]) and torch.equal(norm.bias.detach(),
                                                                                     fx["initial.bias"])
    _load(norm, fx)
    x = fx["input.x"].clone().requires_grad_()
    _check(norm, fx, norm(x), x)


def test_layernorm_1p_everywhere_and_refused_for_rmsnorm():
    """Every norm of the model is 1p, the final one too (Megatron-LM's and Nemotron's; upstream's GPTModelPipe keeps
    a plain final norm, which its pipeline checkpoints' reader converts: megatron/checkpointing/upstream)."""
    from megatron.model.gpt_model import GPTModel

    model = GPTModel(_cfg(apply_layernorm_1p=True), tp=single_process_state().tp)
    norms = [m for m in model.modules() if isinstance(m, Norm)]
    assert len(norms) == 3 and all(n.one_plus and not n.weight.any() for n in norms)
    with pytest.raises(ConfigError, match="--apply-layernorm-1p with --normalization rmsnorm"):
        _cfg(apply_layernorm_1p=True, normalization="rmsnorm").validate()


@pytest.mark.parametrize("other", ["swiglu", "openai_gelu"])
def test_squared_relu_with_another_activation_is_refused(other):
    with pytest.raises(ConfigError, match=f"--squared-relu with --{other.replace('_', '-')}"):
        _cfg(squared_relu=True, **{other: True}).validate()


def _reference_fp32_residual_layer(layer: TransformerLayer, x: torch.Tensor) -> torch.Tensor:
    """The formula of --fp32-residual-connection on a bf16 layer: norms in fp32 (fp32 weights) cast to bf16, attention
    and MLP in bf16, each residual add in fp32."""
    def norm(n: Norm, h: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(h.float(), (HIDDEN,), n.weight.float(), n.bias.float(), n.eps).to(torch.bfloat16)

    h = x + _with_bias(layer.self_attention(norm(layer.input_layernorm, x))).float()
    return h + _with_bias(layer.mlp(norm(layer.post_attention_layernorm, h))).float()


def test_fp32_residual_connection_keeps_the_stream_fp32():
    torch.manual_seed(0)
    layer = TransformerLayer(_cfg(fp32_residual_connection=True), 0, tp=single_process_state().tp)
    layer = layer.to(torch.bfloat16)
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float32, requires_grad=True)
    out = layer(x)
    assert out.dtype == torch.float32
    ref_x = x.detach().clone().requires_grad_()
    ref = _reference_fp32_residual_layer(layer, ref_x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), [x, *layer.parameters()])
    ref_grads = torch.autograd.grad((ref * g).sum(), [ref_x, *layer.parameters()])
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the embedding starts the fp32 stream (upstream: after the transpose, before dropout); an fp32 run refuses it
    emb = Embedding(_cfg(fp32_residual_connection=True), VOCAB, tp=single_process_state().tp).to(torch.bfloat16)
    assert emb(torch.zeros(BATCH, SEQ, dtype=torch.long)).dtype == torch.float32


def test_fp32_residual_connection_needs_16_bit():
    from megatron.config import RunConfig

    with pytest.raises(ConfigError, match="--fp32-residual-connection needs --bf16 or --fp16"):
        RunConfig(model=_cfg(fp32_residual_connection=True))


@pytest.mark.parametrize("shape", [(48, 16), (16, 32), (64, 16)])
def test_xavier_uniform_is_torchs_of_the_full_matrix(shape):
    """--init-method-xavier-uniform: torch.nn.init.xavier_uniform_ of the full weight (upstream's init_method), drawn
    with the parameter's keyed generator; its bound from the full matrix's fans."""
    from megatron.core.tensor_parallel.layers import _stable_seed, initialize_shard

    full = torch.nn.Parameter(torch.empty(shape))
    initialize_shard(full, shape, 0, GroupInfo([0], 0, None), 0.02, 5, "k", False, init_method="xavier_uniform")
    expected = torch.nn.init.xavier_uniform_(torch.empty(shape), generator=torch.Generator().manual_seed(
        _stable_seed(5, "k")))
    assert torch.equal(full.detach(), expected)
    bound = (6.0 / sum(shape)) ** 0.5
    assert full.abs().max() <= bound and abs(full.var().item() - bound ** 2 / 3) < 0.25 * bound ** 2 / 3


def test_xavier_uniform_reaches_every_matrix_and_is_the_same_at_every_tp():
    """Every weight --init-method-std draws is xavier's (no 1/sqrt(2L) output scaling: its bound follows the shape),
    norms and biases keep theirs. With --use-cpu-initialization a TP shard is the slice of the TP=1 weight; without,
    each rank draws its own shard, from the full matrix's bound."""
    from megatron.model.gpt_model import GPTModel

    cfg = _cfg(init_method_xavier_uniform=True, untie_embeddings_and_output_weights=True, num_layers=2,
               use_cpu_initialization=True)
    model = GPTModel(cfg, tp=single_process_state().tp, init_seed=3)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            bound = (6.0 / sum(p.shape)) ** 0.5
            assert p.abs().max() <= bound and p.abs().max() > 0.9 * bound, name
        else:
            assert torch.equal(p, torch.ones_like(p) if name.endswith("norm.weight") else torch.zeros_like(p)), name
    full = model.layers[1].mlp
    shard = TransformerLayer(cfg, 1, tp=GroupInfo([0, 1], 1, None), init_seed=3).mlp
    assert torch.equal(shard.dense_h_to_4h.weight, full.dense_h_to_4h.weight[FFN // 2:])
    assert torch.equal(shard.dense_4h_to_h.weight, full.dense_4h_to_h.weight[:, FFN // 2:])
    own = TransformerLayer(cfg.replace(use_cpu_initialization=False), 1, tp=GroupInfo([0, 1], 1, None)).mlp
    bound = (6.0 / (FFN + HIDDEN)) ** 0.5
    assert not torch.equal(own.dense_h_to_4h.weight, shard.dense_h_to_4h.weight)
    assert bound >= own.dense_h_to_4h.weight.abs().max() > 0.8 * bound


def _configure(*extra: str):
    from megatron.arguments import parse_args
    from megatron.arguments.configs import run_config_from_args
    from tests.models import CONFIG_GPT_L4

    return run_config_from_args(parse_args([*CONFIG_GPT_L4, *extra]), 2, 128)


def test_flags_reach_the_config_with_their_notes_and_refusals():
    run = _configure("--apply-layernorm-1p", "--squared-relu", "--apply-residual-connection-post-layernorm",
                     "--init-method-xavier-uniform", "--embedding-weights-in-fp32", "--standalone-embedding-stage")
    m = run.model
    assert (m.apply_layernorm_1p, m.squared_relu, m.apply_residual_connection_post_layernorm, m.init_method,
            m.embedding_weights_in_fp32, run.parallel.standalone_embedding_stage) == (True,) * 3 + (
        "xavier_uniform", True, True)
    assert "> --embedding-weights-in-fp32 has no effect in an fp32 run: the table is fp32 already" in run.notes
    assert any("--standalone-embedding-stage has no effect with --pipeline-model-parallel-size 1" in n
               for n in run.notes)
    assert _configure("--fp32-residual-connection", "--bf16").model.fp32_residual_connection
    fusion = "> --bias-gelu-fusion falls back with --squared-relu (no GeLU to fuse)"
    assert any(n.startswith(fusion) for n in _configure("--squared-relu", "--compile").notes)
    unfused = _configure("--squared-relu", "--compile", "--no-bias-gelu-fusion").notes + \
        _configure("--squared-relu").notes
    assert not any(n.startswith(fusion) for n in unfused)
    with pytest.raises(ConfigError, match="--onnx-safe True: with --squared-relu upstream runs the erf GeLU"):
        _configure("--squared-relu", "--onnx-safe", "True")
    with pytest.raises(ConfigError, match="--standalone-embedding-stage and --pipeline-model-parallel-size 2: the "
                                          "embedding-only stage 0"):
        _configure("--standalone-embedding-stage", "--pipeline-model-parallel-size", "2", "--num-experts", "2",
                   "--expert-interval", "1")


def test_a_checkpoint_of_another_variant_is_refused():
    """Variants that change what a weight means are part of the shape check; a checkpoint from before they were
    recorded counts as trained without them."""
    from megatron.checkpointing.resume_checks import check_model_shape

    run = _configure("--apply-layernorm-1p")
    saved = dataclasses.asdict(run.model)
    check_model_shape(saved, run, "ckpt")
    with pytest.raises(ConfigError, match=r"--apply-layernorm-1p \(False in the checkpoint, True now\)"):
        check_model_shape({k: v for k, v in saved.items() if k != "apply_layernorm_1p"}, run, "ckpt")
    with pytest.raises(ConfigError, match=r"--squared-relu \(True in the checkpoint, False now\)"):
        check_model_shape({**saved, "squared_relu": True}, run, "ckpt")


def test_memory_model_counts_the_fp32_residual_stream_and_the_fp32_lookup():
    from megatron.perf.layout import Layout
    from megatron.perf.memory import activation_bytes_per_layer, estimate_stage_memory

    m = _cfg(hidden_dropout=0.0)
    layout = Layout.of(micro_batch_size=2, dtype="bf16")
    extra = activation_bytes_per_layer(m.replace(fp32_residual_connection=True), layout) - \
        activation_bytes_per_layer(m, layout)
    assert extra == 2 * SEQ * 2 * HIDDEN * (4 - 2)  # two norm inputs per layer, 4 bytes instead of 2
    lookup = estimate_stage_memory(m.replace(embedding_weights_in_fp32=True), layout, 0).terms["embedding_activations"]
    assert lookup == 4 * VOCAB * HIDDEN
