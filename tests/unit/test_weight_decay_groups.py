"""Which parameters escape weight decay, GPT-2 and Llama variants: upstream's answer written out as data (from
get_param_groups' rule, tests/upstream_weight_decay.py), checked against ours
(megatron.optim.optimizer.param_groups)."""

from __future__ import annotations

import pytest

from megatron.core.parallel_state import single_process_state
from megatron.optim.optimizer import param_groups
from megatron.model.gpt_model import GPTModel
from megatron.config.sizes import named_model
from tests.upstream_weight_decay import upstream_no_decay, upstream_param_groups

_LAYER = "layers.{i}."
# Upstream decays every matrix (embeddings, the learned position table, QKV, attention output, both MLP
# projections, an untied output layer) and no bias nor norm weight ("{i}": each layer).
GPT2 = {
    "decay": ["embedding.word_embeddings.weight", "embedding.position_embeddings",
              _LAYER + "self_attention.query_key_value.weight", _LAYER + "self_attention.dense.weight",
              _LAYER + "mlp.dense_h_to_4h.weight", _LAYER + "mlp.dense_4h_to_h.weight"],
    "no_decay": [_LAYER + "input_layernorm.weight", _LAYER + "input_layernorm.bias",
                 _LAYER + "self_attention.query_key_value.bias", _LAYER + "self_attention.dense.bias",
                 _LAYER + "post_attention_layernorm.weight", _LAYER + "post_attention_layernorm.bias",
                 _LAYER + "mlp.dense_h_to_4h.bias", _LAYER + "mlp.dense_4h_to_h.bias",
                 "final_layernorm.weight", "final_layernorm.bias"],
}
# Llama: RMSNorm (weight only), no linear biases, rotary (no position table), untied output layer.
LLAMA = {
    "decay": ["embedding.word_embeddings.weight", _LAYER + "self_attention.query_key_value.weight",
              _LAYER + "self_attention.dense.weight", _LAYER + "mlp.dense_h_to_4h.weight",
              _LAYER + "mlp.dense_4h_to_h.weight", "output_layer.linear.weight"],
    "no_decay": [_LAYER + "input_layernorm.weight", _LAYER + "post_attention_layernorm.weight",
                 "final_layernorm.weight"],
}
VARIANTS = {"debug": GPT2, "debug-llama": LLAMA}


def _expand(names: list[str], num_layers: int) -> set[str]:
    return {n.format(i=i) for n in names for i in (range(num_layers) if "{i}" in n else [0])}


def _model(size: str) -> GPTModel:
    return GPTModel(named_model(size, use_cpu_initialization=True), tp=single_process_state().tp)


def _split(model: GPTModel, groups: list[dict]) -> dict[str, set[str]]:
    """Parameter names per side, from a list of param groups (a parameter in two groups, or none, fails)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    side = {"decay": set(), "no_decay": set()}
    for g in groups:
        key = "no_decay" if g["weight_decay"] == 0.0 else "decay"
        assert g["wd_mult"] == (0.0 if key == "no_decay" else 1.0), g["wd_mult"]
        side[key] |= {by_id[id(p)] for p in g["params"]}
    assert not side["decay"] & side["no_decay"], side["decay"] & side["no_decay"]
    assert side["decay"] | side["no_decay"] == set(by_id.values())
    return side


@pytest.mark.parametrize("size", sorted(VARIANTS))
def test_the_data_is_upstreams_rule(size):
    """The lists above name every parameter of the built model, each on the side upstream's rule puts it."""
    model, want = _model(size), VARIANTS[size]
    n = model.cfg.num_layers
    expected = {k: _expand(v, n) for k, v in want.items()}
    assert set(dict(model.named_parameters())) == expected["decay"] | expected["no_decay"]
    for name, p in model.named_parameters():
        assert upstream_no_decay(name, p) == (name in expected["no_decay"]), name
    assert _split(model, upstream_param_groups(model, 0.1)) == expected


@pytest.mark.parametrize("size", sorted(VARIANTS))
def test_ours_decays_what_upstream_decays(size):
    model, want = _model(size), VARIANTS[size]
    expected = {k: _expand(v, model.cfg.num_layers) for k, v in want.items()}
    groups = param_groups(model, 0.1)
    assert _split(model, groups) == expected
    assert {g["weight_decay"] for g in groups} == {0.1, 0.0}
