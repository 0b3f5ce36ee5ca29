"""Real Megatron-DeepSpeed job scripts (tests/compat/cases: ORNL's Frontier launchers and upstream's
examples_deepspeed, each naming its source) train here as written, scaled only in model shape, parallel sizes,
batch sizes, iterations, learning rate and data paths (fp16 -> bf16 where this CPU has no fp16).

"Train as written": the iterations and batch sizes the flags imply (upstream's rules, tests/compat/expect.py), the
script's layout and model features in the run's own start-up report, and a loss that falls."""

from __future__ import annotations

import math
import os
import re

import pytest

from tests.compat import cases_io, expect
from tests.launch import losses, run_pretrain

_NOTE = re.compile(r"^> (--\S+) is accepted and has no effect here", re.M)
_MOE_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?\| moe loss: ([0-9.E+-]+)")
# The loss must fall by 1% between the first and the last logged iteration. At initialisation it is ln(512) = 6.24
# (uniform over the padded vocabulary) on every batch within ~0.02, i.e. 0.3%; the cases' learning rates take it
# down by 2% per full-rate update (a warmup's first update has lr 0, so some cases have one such update).
_FALL = 0.01


def _record(name: str, last: float) -> None:
    """MF_RECORD_LOSSES=FILE: append each case's last lm loss (a refactor compares them before and after)."""
    path = os.environ.get("MF_RECORD_LOSSES")
    if path:
        with open(path, "a") as f:
            f.write(f"{name} {last!r}\n")


@pytest.mark.parametrize("name", cases_io.names())
def test_job_script_trains_as_written(name, compat_data, tmp_path, request):
    case = cases_io.load(name)
    if any("$SP_DATA_PATH" in w or "$TOKENIZER_MODEL" in w for w in case.flags):
        compat_data = dict(compat_data, **request.getfixturevalue("compat_sp_data"))
    assert case.source and "@" in case.source, "a case names its source repository, path and commit"
    values = dict(compat_data, CHECKPOINT_PATH=str(tmp_path / "ckpt"), TENSORBOARD_DIR=str(tmp_path / "tb"),
                  MASTER_ADDR="127.0.0.1", DS_CONFIG=case.json or "")
    flags = cases_io.fill(case.flags, values)
    opts = expect.options(flags)
    proc = run_pretrain(case.world, flags, timeout=240, check=False, env=case.env)
    out = proc.stdout
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stderr[-2500:]}\n{out[-1500:]}"

    for what, got, want in (("layout", expect.reported_layout(out), expect.layout(opts, case.world, case.json)),
                            ("model features", expect.reported_features(out), expect.features(opts))):
        assert got is not None, f"{name}: no {what} line at start-up:\n{out[:3000]}"
        assert got == want, f"{name}: the run reports {what} {got}; the script asks for {want}"

    logged = losses(out)
    sizes = expect.batch_sizes(opts, case.world)
    assert sorted(logged) == list(range(1, len(sizes) + 1)), (name, sorted(logged), sizes)
    assert expect.logged_batch_sizes(out) == dict(enumerate(sizes, 1)), (name, sizes)
    assert all(math.isfinite(v) for v in logged.values()), logged
    first, last = logged[1], logged[len(sizes)]
    _record(name, last)
    assert last < first * (1 - _FALL), f"{name}: the loss did not fall: {logged}"

    if "--num-experts" in opts and any(int(n) > 1 for n in opts["--num-experts"]):  # upstream logs it beside lm loss
        moe = {int(i): float(v) for i, v in _MOE_LOSS.findall(out)}
        assert sorted(moe) == sorted(logged) and all(0 < v < 1 for v in moe.values()), f"{name}: moe loss {moe}"

    notes = _NOTE.findall(out)
    assert len(notes) == len(set(notes)), f"a no-op was said more than once: {notes}"
    if "--save" in flags:
        assert os.path.isfile(os.path.join(values["CHECKPOINT_PATH"], "latest")), "the end of training is saved"
