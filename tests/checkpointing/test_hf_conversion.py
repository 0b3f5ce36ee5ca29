"""HF conversion on single-process models: exported GPT2LMHeadModel / LlamaForCausalLM logits equal ours
(fp32, 1e-5), HF -> ours -> HF is exact, and the full-state sharding round trip (merge of TP shards)."""

import pytest
import torch

from megatron.checkpointing.full_state.merge import merge_tp
from megatron.checkpointing.full_state.shard import load_into_model
from megatron.checkpointing.hf.convert import hf_to_full_state, read_any, read_hf, write_hf
from megatron.core.parallel_state import GroupInfo, single_process_state
from megatron.core.tensor_parallel.layers import shard_tensor
from megatron.model.gpt_model import GPTModel
from megatron.model.param_names import canonical_name
from megatron.config.sizes import named_model

VARIANTS = {
    "gpt2": dict(),
    "llama": dict(num_key_value_heads=2),  # debug-llama: RMSNorm, SwiGLU, rotary, untied, no bias; GQA 4/2
    "gpt_neox": dict(position_embedding_type="rope", rotary_percent=0.25),  # GPT-2 shape, partial rotary
    # --apply-layernorm-1p and --squared-relu: Nemotron (rope, GQA), and GPT-2 (1 + weight stored, relu2)
    "nemotron": dict(position_embedding_type="rope", rotary_percent=0.5, num_key_value_heads=2, apply_layernorm_1p=True,
                     squared_relu=True),
    "nemotron_plain_norms": dict(position_embedding_type="rope", rotary_percent=0.5, squared_relu=True),
    "gpt2_1p_relu2": dict(apply_layernorm_1p=True, squared_relu=True),
}
HF_CLASS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "gpt_neox": "GPTNeoXForCausalLM",
            "nemotron": "NemotronForCausalLM", "nemotron_plain_norms": "NemotronForCausalLM",
            "gpt2_1p_relu2": "GPT2LMHeadModel"}


def _model(name: str) -> GPTModel:
    cfg = named_model("debug-llama" if name == "llama" else "debug", vocab_size=200, hidden_dropout=0.0,
                      attention_dropout=0.0, use_cpu_initialization=True, **VARIANTS[name])
    model = GPTModel(cfg, tp=single_process_state().tp, init_seed=3).eval()
    with torch.no_grad():  # norms start at 1/0: perturb them so a swapped or dropped norm would show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _full(model: GPTModel) -> dict:
    full = {canonical_name(k, model.cfg.num_layers): v.detach().clone() for k, v in model.state_dict().items()}
    for k in ("embedding.word_embeddings.weight", "output_layer.linear.weight"):
        if k in full:
            full[k] = full[k][: model.cfg.vocab_size]
    return full


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_logits_and_round_trip(tmp_path, name):
    from dataclasses import asdict

    from transformers import AutoModelForCausalLM

    model = _model(name)
    cfg = asdict(model.cfg)
    write_hf(str(tmp_path / "hf"), _full(model), cfg)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32).eval()
    assert type(hf).__name__ == HF_CLASS[name]
    tokens = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)[..., :200]
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-5

    # HF -> ours -> HF: bit-exact tensors and the same config.
    hf_state, hf_config = read_hf(str(tmp_path / "hf"))
    hf_to_full_state(str(tmp_path / "hf"), str(tmp_path / "ours"))
    full, model_fields, _ = read_any(str(tmp_path / "ours"))
    write_hf(str(tmp_path / "hf2"), full, {**cfg, **model_fields})
    again, again_config = read_hf(str(tmp_path / "hf2"))
    assert again.keys() == hf_state.keys()
    assert all(torch.equal(again[k], hf_state[k]) for k in hf_state)
    assert again_config == hf_config

    # The imported full state shards into a TP=2 model and merges back exactly (partition attributes).
    cfg2 = model.cfg
    shards = []
    for rank in range(2):
        m2 = GPTModel(cfg2, tp=GroupInfo([0, 1], rank, None), init_seed=9)
        load_into_model(m2, full, cfg2.num_layers, 2, rank, "test")
        shards.append(dict(m2.named_parameters()))
    for n, p in shards[0].items():
        name_c = canonical_name(n, cfg2.num_layers)
        if getattr(p, "tensor_model_parallel", False):
            merged = merge_tp([s[n].detach() for s in shards], p.partition_dim, p.partition_stride)
        else:
            merged = p.detach()
        want = full[name_c]
        assert torch.equal(merged[: want.shape[0]], want), n
        assert torch.equal(shard_tensor(merged, 0, 1, 0), merged)


def test_post_layernorm_residual_has_no_hf_export(tmp_path):
    from dataclasses import asdict

    from megatron.errors import ConfigError

    model = _model("gpt2")
    cfg = asdict(model.cfg.replace(apply_residual_connection_post_layernorm=True))
    with pytest.raises(ConfigError, match="--apply-residual-connection-post-layernorm has no HF export"):
        write_hf(str(tmp_path / "hf"), _full(model), cfg)
