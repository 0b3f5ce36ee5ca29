"""Errors knowable from flags and files come before any process group (issue 13, item 2): --load
metadata, --save, optimizer hyper-parameters, batch sizes, --exit-on-missing-checkpoint; README anchors
named by messages exist; a validation error is printed once per job but every rank exits 2."""

import json
import os
import re
import sys

import pytest

from megatron.arguments import parse_args, run_config_from_args
from megatron.checkpointing.resume_checks import RESHARD_DOC
from megatron.checkpointing.state import HZERO_FORMAT, plain_run
from megatron.errors import ConfigError, launcher_rank
from tests.launch import PRETRAIN, REPO, start_ranks
from tests.unit.preflight_common import BASE, assert_one_line_error, run_until_process_group, with_flag


def _fake_checkpoint(root, argv: list[str], world: int, tag: str = "global_step2", meta: bool = True) -> str:
    """A --save directory whose 'latest' names ``tag``, with the megatron_meta.json a run of ``argv`` on
    ``world`` ranks writes (weights are not needed: the checks read metadata only)."""
    run = run_config_from_args(parse_args(argv), world, 128)
    os.makedirs(root / tag, exist_ok=True)
    (root / "latest").write_text(tag)
    if meta:
        (root / tag / "megatron_meta.json").write_text(json.dumps({"iteration": 2, "run": plain_run(run),
                                                                   "has_optimizer": True, "tag": tag}))
    return str(root)


def test_load_at_another_layout_goes_on_and_hierarchical_zero_names_tp_and_a_real_anchor(tmp_path, monkeypatch,
                                                                                          capsys):
    """TP 2 x PP 2 ZeRO-1 at TP 1 x PP 1, and TP 2 ZeRO-3 at TP 1 with another DP: resumed in place
    (megatron/checkpointing/relayout/), so the checks pass; hierarchical ZeRO shards at another TP size are refused
    naming it and the offline conversion (their tiers' shards are read at their own layout only)."""
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "1"]
    ckpt = _fake_checkpoint(tmp_path / "z1", BASE + layout, 4)
    rc, err, out = run_until_process_group(BASE + ["--zero-stage", "1", "--load", ckpt, "--verify-checkpoint", "off"],
                                           monkeypatch, capsys)
    assert rc is None and err == "", err
    ckpt = _fake_checkpoint(tmp_path / "z3", BASE + ["--tensor-model-parallel-size", "2", "--zero-stage", "3"], 4)
    rc, err, out = run_until_process_group(BASE + ["--zero-stage", "3", "--load", ckpt, "--verify-checkpoint", "off"],
                                           monkeypatch, capsys)
    assert rc is None and err == "", err
    hzero = ["--zero-stage", "3", "--zero-hierarchy", "package,node,network"]
    ckpt = _fake_checkpoint(tmp_path / "hz", BASE + hzero + ["--tensor-model-parallel-size", "2"], 8)
    meta_file = os.path.join(ckpt, "global_step2", "megatron_meta.json")
    with open(meta_file) as f:
        meta = json.load(f)
    meta.update(format=HZERO_FORMAT, hierarchy={"dp_size": 4, "levels": ["package", "node", "network"],
                                                "weights": None, "int8": False})
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    rc, err, out = run_until_process_group(BASE + hzero + ["--load", ckpt], monkeypatch, capsys, world_size=4,
                                           local_world_size=2)
    assert_one_line_error(rc, err, out, "--tensor-model-parallel-size 2, now 1", "tools/reshard_checkpoint.py",
                          RESHARD_DOC)
    path, anchor = RESHARD_DOC.split("#")
    with open(os.path.join(REPO, path)) as f:  # GitHub's anchor of a heading: lower case, spaces to dashes
        anchors = {re.sub(r"[^\w\- ]", "", line[2:].strip().lower()).replace(" ", "-")
                   for line in f if line.startswith("#")}
    assert anchor in anchors, sorted(anchors)


def test_load_at_another_dp_keeps_the_data_order_or_refuses(tmp_path, monkeypatch, capsys):
    """A data-parallel size change keeps the global batch and the sample order (--dataloader-type single), or is
    refused in one line: an implicit global batch (micro-batch x DP) would change, cyclic order depends on DP."""
    implicit = [a for i, a in enumerate(BASE) if "--global-batch-size" not in BASE[max(0, i - 1):i + 1]]
    ckpt = _fake_checkpoint(tmp_path / "a", implicit + ["--zero-stage", "1"], 2)
    rc, err, out = run_until_process_group(implicit + ["--zero-stage", "1", "--load", ckpt], monkeypatch, capsys)
    assert_one_line_error(rc, err, out, "--global-batch-size was not given; it was 4 (micro-batch 2 x DP 2) and "
                          "would now be 2: pass --global-batch-size 4")
    cyclic = BASE + ["--zero-stage", "1", "--dataloader-type", "cyclic"]
    ckpt = _fake_checkpoint(tmp_path / "b", cyclic, 2)
    rc, err, out = run_until_process_group(cyclic + ["--load", ckpt], monkeypatch, capsys)
    assert_one_line_error(rc, err, out, "saved at data-parallel size 2, now 1, with --dataloader-type cyclic",
                          "keep DP 2 (2 ranks at TP 1 x PP 1)")


def test_load_shape_mismatch(tmp_path, monkeypatch, capsys):
    ckpt = _fake_checkpoint(tmp_path, with_flag(BASE, "--hidden-size", "128"), 1)
    rc, err, out = run_until_process_group(BASE + ["--load", ckpt], monkeypatch, capsys)
    assert_one_line_error(rc, err, out, "--hidden-size (128 in the checkpoint, 64 now)")


def test_load_markers(tmp_path, monkeypatch, capsys):
    # A checkpoint without megatron_meta.json.
    ckpt = _fake_checkpoint(tmp_path / "a", BASE, 1, meta=False)
    rc, err, out = run_until_process_group(BASE + ["--load", ckpt], monkeypatch, capsys)
    assert_one_line_error(rc, err, out, os.path.join(ckpt, "global_step2", "megatron_meta.json"), "is missing")
    # 'latest' naming a deleted tag.
    ckpt = _fake_checkpoint(tmp_path / "b", BASE, 1)
    (tmp_path / "b" / "latest").write_text("global_step9")
    rc, err, out = run_until_process_group(BASE + ["--load", ckpt], monkeypatch, capsys)
    assert_one_line_error(rc, err, out, os.path.join(ckpt, "global_step9"), "point 'latest' at an existing")


def test_exit_on_missing_checkpoint(tmp_path, monkeypatch, capsys):
    argv = BASE + ["--load", str(tmp_path)]
    rc, err, out = run_until_process_group(argv + ["--exit-on-missing-checkpoint"], monkeypatch, capsys)
    assert_one_line_error(rc, err, out, f"--load {tmp_path}", os.path.join(str(tmp_path), "latest"))
    # Without the flag: today's fresh start, with a warning naming the path (printed by rank 0 only).
    rc, err, out = run_until_process_group(argv, monkeypatch, capsys)
    assert rc is None and err == ""
    assert [line for line in out.splitlines() if "WARNING" in line] == [
        f"> WARNING: --load {tmp_path} holds no checkpoint ({tmp_path}/latest not found): training starts from "
        "scratch (pass --exit-on-missing-checkpoint to make this an error)"]
    rc, err, out = run_until_process_group(argv, monkeypatch, capsys, world_size=2, rank=1)
    assert rc is None and "WARNING" not in out


def test_save_is_probed(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    rc, err, out = run_until_process_group(BASE + ["--save", str(tmp_path / "file" / "ckpt")], monkeypatch, capsys)
    assert_one_line_error(rc, err, out, f"--save {tmp_path / 'file' / 'ckpt'} cannot be created", "Not a directory")
    rc, err, out = run_until_process_group(BASE + ["--save", str(tmp_path / "file")], monkeypatch, capsys)
    assert_one_line_error(rc, err, out, f"--save {tmp_path / 'file'} is a file, not a directory")
    # A good --save is created and its probe file removed.
    rc, err, out = run_until_process_group(BASE + ["--save", str(tmp_path / "new" / "ckpt")], monkeypatch, capsys)
    assert rc is None and err == "" and os.listdir(tmp_path / "new" / "ckpt") == []


@pytest.mark.parametrize("flag, value, needle", [
    # Ranges come from megatron/flag_bounds.py (one row per numeric flag; NaN is outside every range).
    ("--lr", "-1", "--lr -1: out of range; valid: 0 < value"),
    ("--adam-beta1", "1.0", "--adam-beta1 1: out of range; valid: 0 <= value < 1"),
    ("--adam-beta2", "-0.1", "--adam-beta2 -0.1: out of range; valid: 0 <= value < 1"),
    ("--adam-eps", "0", "--adam-eps 0: out of range; valid: 0 < value <= 1"),
    ("--weight-decay", "-0.01", "--weight-decay -0.01: out of range; valid: 0 <= value <= 1"),
    ("--weight-decay", "nan", "--weight-decay nan: out of range; valid: 0 <= value <= 1"),
    ("--micro-batch-size", "0", "--micro-batch-size 0: out of range; valid: 1 <= value <= 65536"),
    ("--zero-stage", "5", "argument --zero-stage: invalid choice: 5"),
    ("--lr-typo", "1", "unrecognized arguments: --lr-typo 1"),
])
def test_flag_values(flag, value, needle, monkeypatch, capsys):
    rc, err, out = run_until_process_group(with_flag(BASE, flag, value), monkeypatch, capsys)
    assert_one_line_error(rc, err, out, needle)


def test_launcher_rank():
    assert launcher_rank({}) == 0
    assert launcher_rank({"RANK": "3", "SLURM_PROCID": "0"}) == 3
    assert launcher_rank({"SLURM_PROCID": "0", "OMPI_COMM_WORLD_RANK": "5"}) == 5  # mpirun inside Slurm
    assert launcher_rank({"SLURM_PROCID": "7"}) == 7
    assert launcher_rank({"PMI_RANK": "2"}) == 2
    with pytest.raises(ConfigError):
        raise ConfigError("x", every_rank=True)


def test_error_once_per_job_exit_2_on_every_rank(tmp_path):
    """Two real ranks of one job (launched without torchrun: they never reach a rendezvous)."""
    (tmp_path / "file").write_text("x")
    argv = [sys.executable, PRETRAIN, *BASE, "--save", str(tmp_path / "file" / "c")]
    with start_ranks(2, argv, str(tmp_path)) as ranks:
        codes = ranks.wait(180)
    results = [(codes[r], ranks.output(r), ranks.output(r, "err")) for r in range(2)]
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 2, (rank, err[-2000:])
        assert "Traceback" not in err and "iteration" not in out and "DeepSpeed engine" not in out
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert errors == ([f"error: --save {tmp_path / 'file' / 'c'} cannot be created (Not a directory: "
                           f"{tmp_path / 'file' / 'c'}): choose a directory whose parents exist as directories "
                           "and that you may write"] if rank == 0 else []), (rank, errors)


def test_hierarchical_zero_partial_node_refused_before_process_group(monkeypatch, capsys):
    argv = BASE + ["--zero-stage", "3", "--zero-hierarchy", "package,node,network"]
    rc, err, out = run_until_process_group(argv, monkeypatch, capsys, world_size=4, local_world_size=8)
    assert_one_line_error(rc, err, out, "--zero-hierarchy", "world size 4 is not a multiple of 8 ranks per node")
    rc, err, _ = run_until_process_group(argv, monkeypatch, capsys, world_size=4, local_world_size=2)
    assert rc is None, err  # whole nodes: the run goes on to the process group


def test_layout_change_names_both_layouts_and_a_vocabulary_padding_change():
    from megatron.checkpointing.resume_checks import check_resume

    def meta(argv, world):
        return {"iteration": 2, "run": plain_run(run_config_from_args(parse_args(argv), world, 200)), "tag": "t"}

    argv = with_flag(BASE, "--vocab-size", "200") + ["--zero-stage", "1", "--make-vocab-size-divisible-by", "32"]
    now = run_config_from_args(parse_args(argv), 1, 200)
    assert check_resume(meta(argv, 1), now, True, "D") is None  # same layout: DeepSpeed's own load, bit for bit
    change = check_resume(meta(argv + ["--tensor-model-parallel-size", "2"], 4), now, True, "D")
    assert (str(change.saved), str(change.now)) == ("TP 2 x PP 1 x DP 2 x EP 1, ZeRO-1 (4 ranks)",
                                                    "TP 1 x PP 1 x DP 1 x EP 1, ZeRO-1 (1 rank)")
    assert change.notes == ("> layout change: the padded vocabulary goes from 256 to 224 rows "
                            "(--make-vocab-size-divisible-by 32 x TP): rows 224-255 are dropped; the loss continues "
                            "close to, not exactly, the straight run's",)
    assert check_resume(meta(argv + ["--zero-stage", "2"], 1), now, True, "D").notes == ()
