"""HF export of models with experts (megatron/checkpointing/hf/moe.py): a pretrain_gpt.py checkpoint at EP=2 x TP=2
with expert TP exports to MixtralForCausalLM whose loss on the next iteration's batch is the run's own; one-process
models of each supported shape export to Mixtral or Qwen2-MoE with logits equal to ours (fp32, 1e-5); what no HF
architecture computes is refused in one line."""

import dataclasses
import io
import json
import os
from contextlib import redirect_stdout

import pytest
import torch

from megatron.checkpointing.hf.convert import read_any, write_hf
from megatron.model.param_names import canonical_name
from megatron.checkpointing.hf.moe import moe_variant
from megatron.config.moe import MoEConfig
from megatron.config.sizes import named_model
from megatron.core.parallel_state import single_process_state
from megatron.errors import ConfigError
from megatron.model.gpt_model import GPTModel
from tests.checkpointing.common import pretrain_on
from tests.models import TINY_LLAMA

VOCAB, SEQ, GBS = 256, 16, 4  # vocab 256: no padding at TP=2 (divisible by 32 x 2), so our softmax sees HF's vocabulary
# No dropping and no second-expert sampling: what HF computes (it has no capacity and no draws).
EXACT = dict(moe_token_dropping=False, moe_top2_2nd_expert_sampling=False)


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.timeout(300)
def test_ep2_tp2_checkpoint_exports_to_mixtral_with_the_runs_loss(tmp_path):
    from megatron.data.mock_dataset import MockGPTDataset
    from tools.convert_checkpoint_to_hf import main as to_hf

    save = str(tmp_path / "ckpt")
    args = TINY_LLAMA + ["--vocab-size", str(VOCAB), "--hidden-dropout", "0", "--attention-dropout", "0",
                           "--train-iters", "3", "--save-interval", "2", "--save", save, "--num-experts", "4",
                           "--expert-interval", "1", "--topk", "2", "--moe-expert-parallel-size", "2",
                           "--tensor-model-parallel-size", "2", "--enable-expert-tensor-parallelism",
                           "--disable-moe-token-dropping", "--disable-moe-top2-2nd-expert-sampling"]
    run = pretrain_on(4, args)
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert to_hf(["--load", save, "--tag", "global_step2", "--out", str(tmp_path / "hf")]) == 0
    assert "MixtralForCausalLM" in printed.getvalue() and "note:" not in printed.getvalue(), printed.getvalue()
    hf = _hf(str(tmp_path / "hf"))
    assert type(hf).__name__ == "MixtralForCausalLM"

    # Iteration 3 trains from the weights saved after iteration 2: its logged loss is the exported model's on
    # iteration 3's batch (mock samples 8-11, each a function of --seed 7 and its index). Every expert of both MoE
    # layers, split over EP and over TP, takes part: a misplaced shard or expert would move the loss.
    ds = MockGPTDataset(3 * GBS, SEQ, VOCAB, 7)
    batch = torch.stack([torch.from_numpy(ds[i]["text"]) for i in range(2 * GBS, 3 * GBS)])
    with torch.no_grad():
        logits = hf(batch[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)).item()
    assert abs(loss - run["losses"][3]) < 1e-5, (loss, run["losses"])
    assert len(set(run["losses"].values())) == 3, run["losses"]  # the weights moved between the iterations

    # The merged experts in a one-process model: the same logits as HF's on other tokens.
    full, fields, _ = read_any(save, "global_step2")
    cfg = named_model("debug-llama", vocab_size=VOCAB, use_cpu_initialization=True).replace(
        **{k: v for k, v in fields.items() if k != "moe"}, moe=MoEConfig(**{**fields["moe"], "num_experts": (4,)}))
    ours = GPTModel(cfg, tp=single_process_state().tp).eval()
    ours.load_state_dict({n: full[canonical_name(n, cfg.num_layers)] for n, _ in ours.named_parameters()})
    with torch.no_grad():
        assert (ours(_tokens()) - hf(_tokens()).logits).abs().max().item() < 1e-5


def _model(**moe) -> GPTModel:
    cfg = named_model("debug-llama", vocab_size=VOCAB, num_layers=4, num_key_value_heads=2, hidden_dropout=0.0,
                      attention_dropout=0.0, use_cpu_initialization=True, moe=MoEConfig(**EXACT, **moe))
    model = GPTModel(cfg, tp=single_process_state().tp, init_seed=3).eval()
    with torch.no_grad():  # norms start at 1: perturb them so a swapped or dropped norm would show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            if p.shape[0] == 4 and p.dim() == 2:  # the gates: sharper routing, so a wrong gate weight shows
                p.mul_(8.0)
    return model


def _export(model: GPTModel, out: str) -> dict:
    full = {canonical_name(k, model.cfg.num_layers): v.detach().clone() for k, v in model.state_dict().items()}
    return write_hf(out, full, dataclasses.asdict(model.cfg))


@pytest.mark.parametrize("moe, want, sparse", [
    # top-1: the gate's probability, not renormalised (Mixtral would weigh 1.0): Qwen2-MoE, norm_topk_prob false
    (dict(num_experts=(4,), topk=1, expert_interval=2), "Qwen2MoeForCausalLM", [1, 3]),
    (dict(num_experts=(4,), topk=2, expert_interval=2), "Qwen2MoeForCausalLM", [1, 3]),  # dense layers between
    (dict(num_experts=(4, 1, 4, 4), topk=2, expert_interval=1), "Qwen2MoeForCausalLM", [0, 2, 3]),  # mlp_only_layers
    (dict(num_experts=(4,), topk=2, expert_interval=1), "MixtralForCausalLM", [0, 1, 2, 3]),
    (dict(num_experts=(4,), topk=3, expert_interval=1), "MixtralForCausalLM", [0, 1, 2, 3]),  # DeepSpeed's top-k
])
def test_one_process_moe_exports_with_our_logits(tmp_path, moe, want, sparse):
    model = _model(**moe)
    config = _export(model, str(tmp_path / "hf"))
    hf = _hf(str(tmp_path / "hf"))
    assert type(hf).__name__ == want == config["architectures"][0]
    assert [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")] == sparse
    with torch.no_grad():
        ours, theirs = model(_tokens()), hf(_tokens()).logits
    assert (ours - theirs).abs().max().item() < 1e-5, (ours - theirs).abs().max().item()
    if moe["topk"] == 1:  # the tolerance tells the routers apart: renormalised top-1 weights misses by far more
        with open(tmp_path / "hf" / "config.json") as f:
            renorm = dict(json.load(f), norm_topk_prob=True)
        with open(tmp_path / "hf" / "config.json", "w") as f:
            json.dump(renorm, f)
        os.remove(tmp_path / "hf" / "integrity.json")
        with torch.no_grad():
            assert (ours - _hf(str(tmp_path / "hf"))(_tokens()).logits).abs().max().item() > 1e-3


@pytest.mark.parametrize("size, fields, moe, match", [
    ("debug", {}, dict(num_experts=(4,)), "Llama-style"),  # GPT-2: layernorm, GELU, learned positions
    ("debug-llama", {"add_bias_linear": True}, dict(num_experts=(4,)), "linear biases"),
    ("debug-llama", {}, dict(num_experts=(4,), mlp_type="residual"), "PR-MoE"),
    ("debug-llama", {"num_layers": 4}, dict(num_experts=(2, 4)), "different expert counts"),
    ("debug-llama", {"rotary_percent": 0.5}, dict(num_experts=(4,)), "partial rotary"),
])
def test_what_no_hf_architecture_computes_is_refused(size, fields, moe, match):
    cfg = named_model(size, vocab_size=VOCAB, moe=MoEConfig(**moe), **fields)
    with pytest.raises(ConfigError, match=match):
        moe_variant(dataclasses.asdict(cfg))


def _hf_moe(kind: str, out: str):
    """A transformers-built Mixtral (top-2, every layer) or Qwen2-MoE (top-1 on layer 1 only: decoder_sparse_step 2,
    layer 3 in mlp_only_layers; no shared expert, no q/k/v bias), saved as transformers saves it."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2))
    else:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
            **common, moe_intermediate_size=96, shared_expert_intermediate_size=0, num_experts=4, num_experts_per_tok=1,
            decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False, qkv_bias=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms away from 1
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("gate.weight"):  # sharper routing: a wrong gate shows
                p.mul_(8.0)
    model.save_pretrained(out)
    return model.eval()


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_hf_moe_imports_with_its_logits_and_exports_back(tmp_path, kind):
    from megatron.arguments import model_config_from_args, parse_args
    from megatron.checkpointing.hf.convert import read_hf
    from tools.convert_checkpoint_to_hf import main as to_hf
    from tools.convert_hf_to_megatron import main as from_hf

    hf = _hf_moe(kind, str(tmp_path / "hf"))
    full_dir = str(tmp_path / "full")
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert from_hf(["--hf", str(tmp_path / "hf"), "--out", full_dir]) == 0
    flags = printed.getvalue().strip().split(f"--load {full_dir} ", 1)[1].split()
    cfg = model_config_from_args(parse_args(flags), VOCAB)
    want_moe = {"mixtral": dict(num_experts=(4,), expert_interval=1, topk=2),
                "qwen2_moe": dict(num_experts=(4, 1), expert_interval=2, topk=1)}[kind]
    assert {k: getattr(cfg.moe, k) for k in want_moe} == want_moe, cfg.moe
    assert not cfg.moe.moe_token_dropping and not cfg.moe.moe_top2_2nd_expert_sampling  # HF's function

    full, fields, _ = read_any(full_dir)
    ours = GPTModel(cfg, tp=single_process_state().tp).eval()
    ours.load_state_dict({n: full[canonical_name(n, cfg.num_layers)] for n, _ in ours.named_parameters()})
    with torch.no_grad():
        assert (ours(_tokens()) - hf(_tokens()).logits).abs().max().item() < 1e-5

    # Ours -> HF: the same tensors under the same names as transformers saved them.
    assert to_hf(["--load", full_dir, "--out", str(tmp_path / "hf2")]) == 0
    (theirs, _), (again, config) = read_hf(str(tmp_path / "hf")), read_hf(str(tmp_path / "hf2"))
    assert config["model_type"] == kind and again.keys() == theirs.keys()
    # Qwen2-MoE's shared expert is 0 wide: its sigmoid gate multiplies zeros, exported as zeros whatever it was.
    shared_gates = [k for k in theirs if "shared_expert_gate" in k]
    assert [k for k in theirs if not torch.equal(again[k], theirs[k])] == shared_gates
    assert all(not again[k].any() for k in shared_gates) and len(shared_gates) == (kind == "qwen2_moe")


@pytest.mark.parametrize("config, match", [
    (dict(model_type="mixtral", num_experts_per_tok=1), "weighs its expert 1.0"),
    (dict(model_type="qwen2_moe", num_experts_per_tok=4), "shared expert"),  # transformers' defaults: 5632 wide
    (dict(model_type="qwen2_moe", num_experts_per_tok=4, shared_expert_intermediate_size=0), "qkv_bias"),
    (dict(model_type="qwen2_moe", num_experts_per_tok=4, shared_expert_intermediate_size=0, qkv_bias=False),
     "norm_topk_prob=False"),
])
def test_hf_moe_import_refuses_what_ours_does_not_compute(config, match):
    from megatron.checkpointing.hf.moe import moe_from_hf

    with pytest.raises(ConfigError, match=match):
        moe_from_hf({}, dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, **config))


def test_export_notes_say_when_hf_computes_otherwise():
    from megatron.checkpointing.hf.moe import match_notes

    trained = dataclasses.asdict(named_model("debug-llama", moe=MoEConfig(num_experts=(4,), topk=2)))
    assert [n.split(":")[0] for n in match_notes(trained)] == ["HF has no expert capacity",
                                                                "HF takes top-2's second largest gate"]
    assert match_notes(dataclasses.asdict(named_model("debug-llama", moe=MoEConfig(num_experts=(4,), topk=2,
                                                                                    **EXACT)))) == []


def test_pipeline_moe_checkpoint_missing_a_stage_is_named(tmp_path):
    """A pipeline checkpoint with experts merges from each stage's model file (tests/checkpointing/
    test_moe_checkpoint.py resumes one resharded); a missing stage file is named, not skipped."""
    from megatron.checkpointing.full_state.merge import merge_checkpoint
    from megatron.errors import CheckpointError

    (tmp_path / "layer_0_expert_0_mp_rank_00_model_states.pt").write_bytes(b"")
    meta = {"partition_table": {}, "run": {"model": {"num_layers": 2, "moe": {"num_experts": [4]}},
                                           "parallel": {"tensor_model_parallel_size": 1, "zero_stage": 1,
                                                        "pipeline_model_parallel_size": 2}}}
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt is missing: stage 0"):
        merge_checkpoint(str(tmp_path), meta)
