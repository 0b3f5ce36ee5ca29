"""Real Megatron-DeepSpeed job scripts (tests/compat/cases: ORNL's Frontier launchers and upstream's
examples_deepspeed, each naming its source) train here as written, scaled only in model shape, parallel sizes,
batch sizes, iterations and data paths (fp16 -> bf16 where this CPU has no fp16)."""

from __future__ import annotations

import math
import os
import re

import pytest

from tests.compat import cases_io
from tests.functional.cli import losses, run_pretrain

_NOTE = re.compile(r"^> (--\S+) is accepted and has no effect here", re.M)


def _iterations(flags: list[str]) -> int | None:
    if "--train-iters" in flags:
        return int(flags[flags.index("--train-iters") + 1])
    return None


@pytest.mark.parametrize("name", cases_io.names())
def test_job_script_trains_as_written(name, compat_data, tmp_path, request):
    case = cases_io.load(name)
    if any("$SP_DATA_PATH" in w or "$TOKENIZER_MODEL" in w for w in case.flags):
        compat_data = dict(compat_data, **request.getfixturevalue("compat_sp_data"))
    assert case.source and "@" in case.source, "a case names its source repository, path and commit"
    values = dict(compat_data, CHECKPOINT_PATH=str(tmp_path / "ckpt"), TENSORBOARD_DIR=str(tmp_path / "tb"),
                  MASTER_ADDR="127.0.0.1", DS_CONFIG=case.json or "")
    flags = cases_io.fill(case.flags, values)
    proc = run_pretrain(case.world, flags, timeout=240, check=False, env=case.env)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stderr[-2500:]}\n{proc.stdout[-1500:]}"
    logged = losses(proc.stdout)
    assert logged, f"{name}: no iteration logged\n{proc.stdout[-2000:]}"
    assert all(math.isfinite(v) for v in logged.values()), logged
    want = _iterations(flags)
    if want is not None:
        assert max(logged) == want, (name, sorted(logged))
    notes = _NOTE.findall(proc.stdout)
    assert len(notes) == len(set(notes)), f"a no-op was said more than once: {notes}"
    if "--save" in flags:
        assert os.path.isfile(os.path.join(values["CHECKPOINT_PATH"], "latest")), "the end of training is saved"
