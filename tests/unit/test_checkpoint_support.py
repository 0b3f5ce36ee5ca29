"""Every engine x checkpoint-flag combination either saves (a real save/resume test names it below) or is refused
by megatron/checkpointing/support.py from the flags alone, in one line, before any process group exists."""

import json

import pytest

from megatron.arguments import parse_args, run_config_from_args
from megatron.checkpointing.support import ENGINES, check_supported, engine_kind
from megatron.engine import build_ds_config
from megatron.errors import ConfigError
from tests.models import CONFIG_GPT, replaced

BASE = replaced(CONFIG_GPT, {"--train-iters": "2", "--vocab-size": "128"})

# Engine -> (world size, flags).
LAYOUTS = {
    "zero0": (2, ["--zero-stage", "0"]),
    "zero1": (2, ["--zero-stage", "1"]),
    "zero2": (2, ["--zero-stage", "2"]),
    "zero3": (2, ["--zero-stage", "3"]),
    "pipeline": (4, ["--zero-stage", "1", "--pipeline-model-parallel-size", "2"]),
    "hpz": (4, ["--zero-stage", "3"]),  # plus the hpZ JSON written by the test
    "hierarchical": (4, ["--zero-stage", "3", "--zero-hierarchy", "package,node,network"]),
}
FLAGS = {"save": ["--save", "CK"], "load": ["--load", "CK"], "no_save_optim": ["--save", "CK", "--no-save-optim"]}
EXPECTED_REFUSALS = {("zero3", "no_save_optim"), ("hpz", "no_save_optim")}

# Where each accepted combination really saves and resumes (a refusal table alone could accept a crash).
REAL_SAVES = {
    "zero0": "tests/checkpointing/test_faults.py (1 rank), test_exits.py",
    "zero1": "tests/checkpointing/test_resume.py::test_zero1_tp2_resume_exact_with_dropout",
    "zero2": "tests/checkpointing/test_resume.py (ZeRO-2 shares ZeRO-1's optimizer and files)",
    "zero3": "tests/checkpointing/test_resume.py::test_zero3_dp2_resume_exact_and_zero_to_fp32",
    "pipeline": "tests/checkpointing/test_resume.py::test_pp2_tp2_llama_resume_export_and_reshard",
    "hpz": "DeepSpeed ZeRO-3 with a secondary partition: the ZeRO-3 files and path",
    "hierarchical": "tests/checkpointing/test_hierarchical_zero_checkpoint.py",
}


def _run(engine: str, flag: str, tmp_path):
    world, flags = LAYOUTS[engine]
    argv = BASE + flags + FLAGS[flag]
    if engine == "hpz":
        path = tmp_path / "hpz.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": 3},
                                    "megatron_frontier": {"zero_hpz": "node", "ranks_per_node": 2}}))
        argv += ["--deepspeed_config", str(path)]
    args = parse_args(argv)
    run = run_config_from_args(args, world, 128)
    return run, build_ds_config(run), run.checkpoint


@pytest.mark.parametrize("flag", sorted(FLAGS))
@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_saves_or_is_refused_up_front(engine, flag, tmp_path):
    run, ds_config, settings = _run(engine, flag, tmp_path)
    assert engine_kind(run, ds_config) == engine
    if (engine, flag) in EXPECTED_REFUSALS:
        with pytest.raises(ConfigError) as e:
            check_supported(run, ds_config, settings)
        assert "\n" not in str(e.value) and "--no-save-optim" in str(e.value)
    else:
        check_supported(run, ds_config, settings)
        assert REAL_SAVES[engine]


def test_tables_cover_every_engine():
    assert set(LAYOUTS) == set(REAL_SAVES) == set(ENGINES)
