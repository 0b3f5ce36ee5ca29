"""Checkpoint integrity (issue 24) on 2 gloo ranks: a full disk during a save is one line on every rank, the
temporary directory goes and ``latest``'s checkpoint resumes bit for bit; flipped bytes in a model, optimizer,
pipeline-layer and hierarchical-ZeRO file are one line naming the file before any weight is used; a missing shard
is refused before any process group; tools/verify_checkpoint.py passes a whole checkpoint and lists each damaged
file (also of a full-state export)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.checkpointing.common import EXACT, FAULT, exact_losses, pretrain_on
from tests.launch import PRETRAIN, free_port, rank_env, run_distributed, start_ranks
from tests.models import CKPT_GPT

PP2 = ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"]  # 2 ranks: layer, model and optimizer files

# Rank 1's file system fills up as it opens its first file of the step-4 save; every logged loss is printed exactly
# (common.EXACT) so the resume can be compared bit for bit.
FULL_DISK = "rank=1,phase=write,file=global_step4.tmp-,action=raise:ENOSPC"


def _ranks(world: int, argv: list[str], out_dir: str, exact: bool = False, fault: str | None = None,
           ports: list[int] | None = None, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """``world`` ranks of pretrain_gpt.py (``exact``: common.EXACT) launched as separate processes, one exit code
    each; ``ports``: one per rank to keep them from ever forming a process group."""
    os.makedirs(out_dir, exist_ok=True)
    cmd = [sys.executable, "-c", EXACT] if exact else [sys.executable, PRETRAIN]
    with start_ranks(world, cmd + argv, out_dir, env={FAULT: fault} if fault else None,
                     rank_vars=(lambda r, w, _: rank_env(r, w, ports[r])) if ports else None) as ranks:
        codes = ranks.wait(timeout)
    return [subprocess.CompletedProcess(cmd, codes[r], ranks.output(r), ranks.output(r, "err")) for r in range(world)]


def _flip(path: str) -> None:
    """Invert 32 bytes in the middle of a file (its size stays the same)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        data = f.read(32)
        f.seek(-len(data), 1)
        f.write(bytes(255 - b for b in data))


def _damaged_copy(src: str, dst: str, name: str, how=_flip) -> str:
    shutil.copytree(src, dst)
    how(os.path.join(dst, name))
    return dst


def _out(capsys) -> list[str]:
    """What the checker printed (DeepSpeed's import-time warning, printed in-process, left out)."""
    return [ln for ln in capsys.readouterr().out.strip().splitlines() if "[WARNING]" not in ln]


def _verify_cases(cases: list[tuple[str, str]]) -> list:
    """On each rank: the collective verification of every case, in both modes; the error text or None."""
    import deepspeed

    from megatron.checkpointing.live.verify import verify_collective
    from megatron.errors import CheckpointError

    deepspeed.init_distributed("gloo")  # megatron.core.comm goes through deepspeed.comm
    out = []
    for ckpt, mode in cases:
        try:
            verify_collective(ckpt, mode, lambda _: None)
            out.append(None)
        except CheckpointError as e:
            out.append(str(e))
    return out


@pytest.mark.timeout(600)
def test_full_disk_one_line_resume_exact_and_damaged_files_refused(tmp_path, capsys):
    from tools.verify_checkpoint import main as verify_tool

    save = str(tmp_path / "ckpt")
    args = CKPT_GPT + PP2 + ["--train-iters", "4"]
    ranks = _ranks(2, args + ["--save", save, "--save-interval", "2"], str(tmp_path / "full"), exact=True,
                   fault=FULL_DISK)
    for r, out in enumerate(ranks):  # every rank exits 2; the job's one error line, no traceback
        assert out.returncode == 2, (r, out.stderr[-3000:])
        assert "Traceback" not in out.stderr, (r, out.stderr[-3000:])
    last = ranks[0].stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint save to {save} failed: out of space (ENOSPC"), last
    assert "the checkpoint needs about" in last and "were free when the save began" in last, last
    assert "removed" in last and "'latest' still names global_step2" in last, last
    assert open(os.path.join(save, "latest")).read() == "global_step2"
    assert not [n for n in os.listdir(save) if ".tmp-" in n], os.listdir(save)  # the temporary directory is gone
    exact = exact_losses(ranks[0].stdout)
    assert sorted(exact) == [1, 2, 3, 4], ranks[0].stdout[-2000:]
    resumed = pretrain_on(2, args + ["--load", save])["losses"]
    assert resumed == {3: exact[3], 4: exact[4]}, (resumed, exact)  # bit for bit

    # Every file of the committed checkpoint is in its manifest; the checker passes it.
    step2 = os.path.join(save, "global_step2")
    manifest = json.load(open(os.path.join(step2, "integrity.json")))["files"]
    assert sorted(manifest) == sorted(set(os.listdir(step2)) - {"integrity.json"})
    assert {"layer_01-model_00-model_states.pt", "mp_rank_01_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt"} <= set(manifest)
    capsys.readouterr()
    assert verify_tool([save]) == 0 and _out(capsys)[-1].startswith(f"ok: {step2}: {len(manifest)} files")

    # One hierarchical ZeRO checkpoint (2 ranks, one node).
    hz = str(tmp_path / "hz")
    pretrain_on(2, CKPT_GPT + ["--zero-stage", "3", "--zero-hierarchy", "node,network", "--train-iters", "1",
                               "--lr-warmup-iters", "0", "--save", hz])
    files = {"model": "mp_rank_00_model_states.pt", "optimizer": "zero_pp_rank_0_mp_rank_01_optim_states.pt",
             "layer": "layer_02-model_00-model_states.pt"}
    cases = {k: _damaged_copy(save, str(tmp_path / k), os.path.join("global_step2", n)) for k, n in files.items()}
    files["hzero"] = "hzero_rank_00001.pt"
    cases["hzero"] = _damaged_copy(hz, str(tmp_path / "hzero"), os.path.join("global_step1", files["hzero"]))
    dirs = {k: os.path.join(d, "global_step1" if k == "hzero" else "global_step2") for k, d in cases.items()}
    got = run_distributed(_verify_cases, 2, cases=[(dirs[k], m) for k in files for m in ("full", "size")]
                          + [(step2, "full"), (os.path.join(hz, "global_step1"), "full")])
    assert got[0] == got[1]  # both ranks reach the same verdict
    for i, kind in enumerate(files):
        full, size_only = got[0][2 * i], got[0][2 * i + 1]
        path = os.path.join(dirs[kind], files[kind])
        assert full == (f"checkpoint file {path} fails its checksum (damaged bytes): checkpoint {dirs[kind]} is "
                        f"damaged; copy it again, or load an older checkpoint (edit {cases[kind]}/latest); python "
                        f"tools/verify_checkpoint.py {cases[kind]} lists every damaged file"), (kind, full)
        assert size_only is None  # the size is unchanged: only the checksum finds flipped bytes
    assert got[0][-2:] == [None, None]  # the whole checkpoints pass

    # The CLI on a damaged optimizer file: one line naming it, exit 2 on every rank, no iteration.
    ranks = _ranks(2, args + ["--load", cases["optimizer"]], str(tmp_path / "damaged"))
    assert [r.returncode for r in ranks] == [2, 2], ranks[1].stderr[-3000:]
    last = ranks[0].stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint file {os.path.join(dirs['optimizer'], files['optimizer'])} fails its "
                           "checksum"), last
    assert not any("lm loss" in r.stdout or "Traceback" in r.stderr for r in ranks)

    # A missing shard is refused before any process group: each rank alone (ports differ, they cannot meet).
    shutil.rmtree(cases["model"])
    gone = _damaged_copy(save, cases["model"], os.path.join("global_step2", files["optimizer"]), how=os.remove)
    ranks = _ranks(2, args + ["--load", gone, "--distributed-timeout-minutes", "1"], str(tmp_path / "missing"),
                   ports=[free_port(), free_port()], timeout=120)
    missing = os.path.join(gone, "global_step2", files["optimizer"])
    assert [r.returncode for r in ranks] == [2, 2], ranks[0].stderr[-3000:]
    assert ranks[0].stderr.strip().splitlines()[-1].startswith(f"error: checkpoint file {missing} is missing"), \
        ranks[0].stderr[-2000:]

    # The checker lists every damaged file, one a line (a flipped layer file and the missing optimizer file).
    _flip(os.path.join(gone, "global_step2", files["layer"]))
    capsys.readouterr()
    assert verify_tool([gone]) == 1
    lines = _out(capsys)
    assert lines == [f"{os.path.join(gone, 'global_step2', files['layer'])}: checksum mismatch " + lines[0].split(
        "checksum mismatch ", 1)[1], f"{missing}: missing"], lines

    # A full-state export carries a manifest too; the checker names its damaged weights file.
    from tools.reshard_checkpoint import main as reshard

    full = str(tmp_path / "full")
    assert reshard(["--load", save, "--save", full]) == 0
    capsys.readouterr()
    assert verify_tool([full]) == 0 and _out(capsys)[-1].startswith(f"ok: {full}: ")
    _flip(os.path.join(full, "model.safetensors"))
    assert verify_tool([full]) == 1
    lines = _out(capsys)
    assert len(lines) == 1 and lines[0].startswith(f"{os.path.join(full, 'model.safetensors')}: checksum mismatch"), \
        lines
