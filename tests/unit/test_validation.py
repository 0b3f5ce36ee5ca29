"""Every user-caused configuration error gives one line that names the flags, and exit code 2."""

import json

import pytest

import pretrain_gpt
from megatron.errors import run_cli
from tests.launch import run_pretrain
from tests.models import CONFIG_GPT_H64

BASE = CONFIG_GPT_H64


def _with(flag: str, value: str | None = None) -> list[str]:
    """BASE with ``flag`` replaced (or appended)."""
    argv = list(BASE)
    if flag in argv:
        i = argv.index(flag)
        del argv[i:i + 2]
    return argv + [flag] + ([value] if value is not None else [])


def _run(argv, monkeypatch, capsys, world_size=1):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world_size))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    rc = run_cli(pretrain_gpt.main, argv)
    err = capsys.readouterr().err.strip()
    return rc, err


@pytest.mark.parametrize("argv, world, needles", [
    (_with("--tensor-model-parallel-size", "2"), 3, ["world size 3", "--tensor-model-parallel-size 2"]),
    (_with("--tensor-model-parallel-size", "3"), 3, ["--num-attention-heads 4", "--tensor-model-parallel-size 3"]),
    (_with("--num-key-value-heads", "3"), 1, ["--num-key-value-heads 3", "--num-attention-heads 4"]),
    (_with("--hidden-size", "66"), 1, ["--hidden-size 66", "--num-attention-heads 4"]),
    (_with("--global-batch-size", "6"), 2, ["--global-batch-size 6", "--micro-batch-size 2", "4"]),
    (_with("--max-position-embeddings", "16"), 1, ["--seq-length 32", "--max-position-embeddings 16"]),
    (BASE + ["--fp16", "--bf16"], 1, ["--fp16", "--bf16"]),
    (_with("--deepspeed_config", "/nonexistent/ds.json"), 1, ["--deepspeed_config /nonexistent/ds.json",
                                                              "not found"]),
    (_with("--train-iters", None)[:-1], 1, ["--train-iters"]),
    # pipeline schedules (megatron/core/pipeline): what a schedule cannot serve, before any process group
    (BASE + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"], 2,
     ["--num-layers-per-virtual-pipeline-stage 3", "--num-layers 2", "--pipeline-model-parallel-size 2"]),
    (BASE + ["--pipeline-model-parallel-size", "4"], 4, ["--pipeline-model-parallel-size 4", "--num-layers 2"]),
    (BASE + ["--pipeline-model-parallel-size", "2", "--zero-stage", "2", "--enable-zbh1-pipeline"], 2,
     ["ZeRO-2", "--pipeline-model-parallel-size 2"]),
    (BASE + ["--enable-zbh1-exact-semantics"], 1, ["--enable-zbh1-exact-semantics", "--enable-zbh1-pipeline"]),
    (_with("--num-layers", "4") + ["--pipeline-model-parallel-size", "2", "--enable-zbh1-pipeline",
                                    "--num-layers-per-virtual-pipeline-stage", "1"], 2,
     ["--enable-zbh1-pipeline", "--num-layers-per-virtual-pipeline-stage"]),
    (_with("--num-layers", "4") + ["--pipeline-model-parallel-size", "2", "--standalone-embedding-stage",
                                    "--num-layers-per-virtual-pipeline-stage", "1"], 2,
     ["--num-layers-per-virtual-pipeline-stage 1", "--standalone-embedding-stage"]),
])
def test_config_errors_are_one_line(argv, world, needles, monkeypatch, capsys):
    rc, err = _run(argv, monkeypatch, capsys, world)
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ")
    for n in needles:
        assert n in err, f"{n!r} missing from {err!r}"


def test_ds_config_batch_disagreement_names_both_values(tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}))
    rc, err = _run(_with("--deepspeed_config", str(cfg)), monkeypatch, capsys)
    assert rc == 2 and len(err.splitlines()) == 1
    assert "train_batch_size=16" in err and "--global-batch-size gives 8" in err


def test_ds_config_invalid_json(tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"train_batch_size": 8,,}')
    rc, err = _run(_with("--deepspeed_config", str(cfg)), monkeypatch, capsys)
    assert rc == 2 and len(err.splitlines()) == 1
    assert str(cfg) in err and "not valid JSON" in err and "line 1" in err


def test_cli_prints_no_traceback():
    """The real entry point: one stderr line (besides library warnings), exit 2."""
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    proc = run_pretrain(1, BASE + ["--fp16", "--bf16"], timeout=120, env=env, check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--fp16" in errors[0]


def test_a_change_of_chunks_per_rank_is_told_from_the_metadata():
    """1F1B <-> ZB-H1 place the layers alike (the optimizer files load as they are); interleaving places them
    otherwise: the Adam moments are then carried by name (tests/checkpointing/test_schedule_resume.py runs it)."""
    import dataclasses

    from megatron.checkpointing.resume_checks import chunks_changed
    from tests.distributed.test_pipeline_schedules import _run_config

    def saved(schedule: str) -> dict:
        return {"run": {"parallel": dataclasses.asdict(_run_config("pp4", schedule, 4).parallel),
                        "model": {"num_layers": 8}}}

    assert not chunks_changed(saved("1f1b"), _run_config("pp4", "zbh1", 4))
    assert chunks_changed(saved("1f1b"), _run_config("pp4", "interleaved", 4))
    assert chunks_changed(saved("interleaved"), _run_config("pp4", "1f1b", 4))
    assert not chunks_changed(saved("interleaved"), _run_config("pp4", "interleaved", 4))


def test_another_layout_and_another_chunk_count_at_once_are_refused():
    """relayout/ reads stages of consecutive layers: with interleaved chunks on either side a layout change is one
    line (change one, save, then the other); the same layout changes its chunks by name (above)."""
    import dataclasses

    from megatron.checkpointing.resume_checks import check_resume
    from megatron.errors import ConfigError
    from tests.distributed.test_pipeline_schedules import _run_config

    def saved(schedule: str, world: int) -> dict:
        return {"run": dataclasses.asdict(_run_config("pp2-dp2-zero1-bf16", schedule, world))}

    assert check_resume(saved("1f1b", 4), _run_config("pp2-dp2-zero1-bf16", "1f1b", 2), True, "ck") is not None
    for was, now in (("interleaved", "1f1b"), ("1f1b", "interleaved"), ("interleaved", "interleaved")):
        with pytest.raises(ConfigError, match=r"--load ck: another layout \(TP 1 x PP 2 x DP 2 .* together with the "
                                              r"interleaved schedule .* change one at a time"):
            check_resume(saved(was, 4), _run_config("pp2-dp2-zero1-bf16", now, 2), True, "ck")
