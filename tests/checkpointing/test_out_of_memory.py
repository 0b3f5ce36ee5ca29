"""Out of memory named, not a traceback: a model whose estimate is several times what the process can hold stops in
one line before the model is built; forced past that check (--skip-memory-check) under a capped address space
(``ulimit -v``), the allocation failure is one line naming the rank, host and phase."""

import os
import re
import subprocess
import sys

import pytest

from tests.launch import PRETRAIN, clean_env, free_port, run_command

LIMIT_KB = 4_000_000  # ~3.8 GiB of address space: torch, DeepSpeed and a gloo group need about 1.5
# ~805M parameters: 3 GiB of fp32 weights alone, ~13 GiB with gradients and Adam's states.
BIG = ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "64",
       "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "2", "--lr", "1e-4", "--mock-data",
       "--vocab-size", "512", "--eval-iters", "0", "--use-cpu-initialization", "--distributed-backend", "gloo"]


def _run_capped(args: list[str]) -> subprocess.CompletedProcess:
    script = f"ulimit -v {LIMIT_KB} && exec {sys.executable} {PRETRAIN} " + " ".join(args)
    return run_command(["bash", "-c", script], 150, env=clean_env({"MASTER_PORT": str(free_port())}))


@pytest.mark.timeout(200)
def test_model_that_cannot_fit_stops_before_building_then_a_forced_allocation_failure_is_one_line(tmp_path):
    out = _run_capped(BIG)
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    m = re.fullmatch(r"error: the model does not fit: the memory model estimates ([\d.]+) GiB per rank \(worst "
                     r"pipeline stage 0: .*\) and rank 0 \(host \S+, GCD -\) can hold ([\d.]+) GiB \(ulimit -v "
                     r"3.81 GiB, less [\d.]+ GiB already mapped\); no single or paired change .* fits on 1 "
                     r"rank\(s\): use more nodes \(--skip-memory-check builds it anyway\)", last)
    assert m and float(m.group(1)) > 3 * float(m.group(2)), last
    assert "built GPTModel" not in out.stdout and "Traceback" not in out.stderr

    save = str(tmp_path / "run")
    out = _run_capped(BIG + ["--skip-memory-check", "--save", save])
    assert out.returncode == 3, out.stderr[-3000:]
    assert "> WARNING: the memory model estimates" in out.stdout
    last = out.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"error: rank 0 \(host \S+, GCD -\) ran out of host memory in setup: .*can't allocate "
                        r"memory.*; lower --micro-batch-size, raise --zero-stage, .*", last), last
    assert "Traceback" not in out.stderr and len([x for x in out.stderr.splitlines() if x.startswith("error:")]) == 1
    record = open(os.path.join(save, "failures.jsonl")).read()
    assert '"cause": "out_of_memory"' in record and '"rank": 0' in record
