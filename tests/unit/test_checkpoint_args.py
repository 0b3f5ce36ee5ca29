"""--use-checkpoint-args and --load-tag without a launch: the model taken from each format --load reads (ours, a full
state, upstream's global_stepN/, iter_N/ and universal form), a disagreeing shape flag named in one line, a tag
found (or named missing, with the tags there) whatever 'latest' says. The resumed run's loss is
tests/checkpointing/test_checkpoint_args.py's."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

import pretrain_gpt
from megatron.arguments import configure
from megatron.arguments.dry_run import configure_dry_run
from megatron.checkpointing import classify_load
from megatron.config import CheckpointSettings
from megatron.errors import CheckpointError, ConfigError
from tests.models import GPT_H32_V200

UPSTREAM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "upstream_ckpt")
RUN = ["--mock-data", "--vocab-size", "200", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters",
       "4", "--lr", "1e-3"]
# The checkpoint's model: nothing of it is a default the command line would give by itself.
SAVED = GPT_H32_V200.config(num_layers=3, hidden_size=48, normalization="rmsnorm", swiglu=True,
                            position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                            add_bias_linear=False, num_key_value_heads=2, layernorm_epsilon=1e-6, rotary_base=500.0)


def _ours(load, tag: str, model, tp: int = 1) -> None:
    """A checkpoint of ours as far as its metadata goes (what --use-checkpoint-args and classify_load read)."""
    os.makedirs(load / tag)
    parallel = {"world_size": 2, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1}
    (load / tag / "megatron_meta.json").write_text(json.dumps({"run": {"model": dataclasses.asdict(model),
                                                                       "parallel": parallel}}))


@pytest.fixture
def ours(tmp_path):
    """global_step3 (SAVED, TP=2) and global_step6 (another model), 'latest' naming the latter."""
    _ours(tmp_path, "global_step3", SAVED, tp=2)
    _ours(tmp_path, "global_step6", GPT_H32_V200.config())
    (tmp_path / "latest").write_text("global_step6")
    return tmp_path


def _configure(argv, world: int = 2):
    return configure(RUN + argv, world, pretrain_gpt.tokenizer_provider)[0]


def test_model_and_layout_taken_from_the_tag_not_latest(ours, capsys):
    run = _configure(["--load", str(ours), "--load-tag", "global_step3", "--use-checkpoint-args"])
    m = run.model
    shape = (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_key_value_heads, m.seq_length)
    assert shape == (3, 48, 4, 2, 16)
    assert (m.normalization, m.swiglu, m.position_embedding_type, m.untie_embeddings_and_output_weights,
            m.add_bias_linear, m.layernorm_epsilon, m.rotary_base) == ("rmsnorm", True, "rope", True, False, 1e-6,
                                                                       500.0)
    assert m.ffn_hidden_size == SAVED.ffn_hidden_size and m.make_vocab_size_divisible_by == 32
    assert run.parallel.tp == 2  # ours resumes at its own TP/PP
    assert run.checkpoint.load_tag == "global_step3"
    line = [x for x in capsys.readouterr().out.splitlines() if "--use-checkpoint-args" in x]
    assert len(line) == 1 and line[0].startswith(f"> --use-checkpoint-args: the model of {ours / 'global_step3'}: "
                                                 "--num-layers 3 --hidden-size 48 "), line
    assert "--disable-bias-linear" in line[0] and "--tensor-model-parallel-size 2" in line[0]
    # Without the tag: 'latest' (global_step6), the other model.
    assert _configure(["--load", str(ours), "--use-checkpoint-args"], world=1).model.num_layers == 2
    # The dry run takes it as training does.
    dry = configure_dry_run(["--world-size", "2", "--load", str(ours), "--load-tag", "global_step3",
                             "--use-checkpoint-args"], 8)
    assert (dry.run.model.num_layers, dry.run.model.hidden_size, dry.run.parallel.tp) == (3, 48, 2)


def test_given_flags_must_agree_all_named_in_one_line(ours):
    base = ["--load", str(ours), "--load-tag", "global_step3", "--use-checkpoint-args"]
    # Agreeing flags are fine (the same value, given).
    assert _configure(base + ["--num-layers", "3", "--swiglu", "--tensor-model-parallel-size", "2"]).model.swiglu
    with pytest.raises(ConfigError) as e:
        _configure(base + ["--num-layers", "4", "--hidden-size", "48", "--seq-length", "32",
                           "--use-rotary-position-embeddings", "--tensor-model-parallel-size", "1"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--use-checkpoint-args: --num-layers 4 given, the checkpoint has 3; "
                                              "--seq-length 32 given, the checkpoint has 16; ")
    assert "--tensor-model-parallel-size 1 given, the checkpoint has 2" in msg
    assert "--hidden-size" not in msg and "--position-embedding-type" not in msg  # these agree
    with pytest.raises(ConfigError, match="--use-checkpoint-args: --model-size debug gives --num-layers 2, the "
                                          "checkpoint has 3; --model-size debug gives --hidden-size 64"):
        _configure(base + ["--model-size", "debug"])
    with pytest.raises(ConfigError, match="--use-checkpoint-args: --disable-bias-linear given, the checkpoint was "
                                          "trained without it"):
        _configure(["--load", str(ours), "--use-checkpoint-args", "--disable-bias-linear"], world=1)


def test_variants_that_change_the_arithmetic_are_taken(tmp_path):
    """The 1p norm, squared ReLU and post-LN residual come from the checkpoint as its shape does (upstream forces
    apply_layernorm_1p); one given against it is named."""
    variant = dataclasses.replace(SAVED, normalization="layernorm", swiglu=False, apply_layernorm_1p=True,
                                  squared_relu=True, apply_residual_connection_post_layernorm=True)
    _ours(tmp_path, "global_step3", variant)
    (tmp_path / "latest").write_text("global_step3")
    m = _configure(["--load", str(tmp_path), "--use-checkpoint-args"], world=1).model
    assert (m.apply_layernorm_1p, m.squared_relu, m.apply_residual_connection_post_layernorm) == (True, True, True)
    with pytest.raises(ConfigError, match="--use-checkpoint-args: --swiglu given, the checkpoint was trained without"):
        _configure(["--load", str(tmp_path), "--use-checkpoint-args", "--swiglu"], world=1)


def test_refusals(ours, tmp_path_factory):
    with pytest.raises(ConfigError, match="--use-checkpoint-args needs --load DIR"):
        _configure(["--use-checkpoint-args"])
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(ConfigError, match=f"--load {empty} holds no checkpoint to take the model from"):
        _configure(["--load", str(empty), "--use-checkpoint-args"])
    with pytest.raises(ConfigError, match="--load-tag global_step3 without --load"):
        _configure(["--load-tag", "global_step3", "--num-layers", "2", "--hidden-size", "32",
                    "--num-attention-heads", "4", "--seq-length", "16"])
    with pytest.raises(CheckpointError, match=f"--load-tag global_step9: {ours / 'global_step9'} not found; the "
                                              f"tags in {ours} are global_step3, global_step6"):
        classify_load(CheckpointSettings(load=str(ours), load_tag="global_step9"))
    (ours / "junk").mkdir()
    with pytest.raises(CheckpointError, match="--load-tag junk: .* holds no checkpoint this trainer reads"):
        classify_load(CheckpointSettings(load=str(ours), load_tag="junk"))


def test_full_state_gives_its_model_and_has_no_tags(tmp_path):
    (tmp_path / "full_state.json").write_text(json.dumps({"model": dataclasses.asdict(SAVED)}))
    run = _configure(["--load", str(tmp_path), "--use-checkpoint-args", "--tensor-model-parallel-size", "1"])
    assert (run.model.num_layers, run.model.hidden_size, run.model.swiglu) == (3, 48, True)
    assert run.parallel.tp == 1  # a full state loads at any layout: the command line's
    with pytest.raises(CheckpointError, match="--load-tag x: --load .* is a full-state directory"):
        classify_load(CheckpointSettings(load=str(tmp_path), load_tag="x"))


@pytest.mark.parametrize("layout,tag,kind,universal", [
    ("tp2_zero1", None, "deepspeed", False), ("tp2_zero1", "global_step3", "deepspeed", False),
    ("megatron_tp2", "iter_0000003", "megatron", False),
    ("universal_tp2", "global_step3_universal", "universal", True)])
def test_upstream_checkpoints_give_their_model(layout, tag, kind, universal):
    """Upstream's flags (its pickled args, with --trust-checkpoint) under every layout it writes; the tag names the
    iteration's directory as DeepSpeed's load_checkpoint(tag=) does."""
    load = os.path.join(UPSTREAM, layout)
    target = classify_load(CheckpointSettings(load=load, load_tag=tag, universal_checkpoint=universal))
    assert (target.kind, target.found.kind, target.found.iteration) == ("upstream", kind, 3)
    argv = ["--load", load, "--use-checkpoint-args", "--trust-checkpoint"] + (["--load-tag", tag] if tag else []) + \
        (["--universal-checkpoint"] if universal else [])
    m = _configure(argv, world=1).model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.seq_length,
            m.max_position_embeddings, m.make_vocab_size_divisible_by, m.openai_gelu) == (2, 64, 128, 4, 64, 64, 64,
                                                                                          True)
    if layout == "tp2_zero1" and tag is None:
        with pytest.raises(CheckpointError, match="--trust-checkpoint"):
            _configure(argv[:-1], world=1)
