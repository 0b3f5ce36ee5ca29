"""Integrity manifest pieces without a process group: the hashing writer equals a hash of the file it wrote, a
failed or short write surfaces as the OSError (not torch's wrapper), a manifest-less checkpoint is checked against
its layout, and the start-up warning when --save's file system cannot hold one checkpoint."""

import errno

import pytest
import torch
import xxhash

from megatron.checkpointing.ds_layout.files import expected_files
from megatron.checkpointing.live import integrity, space
from megatron.checkpointing.live.verify import missing_or_short
from megatron.checkpointing.locate import expected_files as layout_of
from tests.models import GPT_H32


def test_written_hash_is_the_files_hash_and_the_reread_agrees(tmp_path):
    path = str(tmp_path / "a.pt")
    state = {"w": torch.randn(300, 70), "b": torch.arange(5), "step": 3}
    integrity.write_torch(state, path)
    entry = integrity.recorded(str(tmp_path))["a.pt"]
    data = open(path, "rb").read()
    assert entry == {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
    assert integrity.hash_file(path) == (len(data), entry["xxh3_128"])
    assert torch.equal(torch.load(path, weights_only=True)["w"], state["w"])
    assert integrity.recorded(str(tmp_path)) == {}  # handed over once


class _Short:
    """A file whose file system takes only part of each write after the first."""

    def __init__(self, f):
        self.f, self.n = f, 0

    def write(self, data):
        self.n += 1
        return self.f.write(data) if self.n == 1 else self.f.write(bytes(memoryview(data)[:1]))

    def flush(self):
        self.f.flush()


def test_short_write_and_enospc_are_the_oserror(tmp_path, monkeypatch):
    init = integrity.HashingWriter.__init__
    monkeypatch.setattr(integrity.HashingWriter, "__init__", lambda self, f: init(self, _Short(f)))
    with pytest.raises(OSError) as e:
        integrity.write_torch({"w": torch.randn(1000)}, str(tmp_path / "b.pt"))
    assert e.value.errno == errno.ENOSPC and "short write" in str(e.value)
    assert integrity.recorded(str(tmp_path)) == {}  # nothing recorded for a failed file


def test_layout_without_manifest(tmp_path):
    meta = {"run": {"parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2,
                                 "world_size": 4, "zero_stage": 1}}, "has_optimizer": True}
    names = ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt", "layer_00-model_00-model_states.pt",
             "layer_02-model_00-model_states.pt"] + [f"zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt"
                                                     for d in range(2) for m in range(2)]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    (tmp_path / "zero_pp_rank_1_mp_rank_01_optim_states.pt").write_bytes(b"")
    assert len(expected_files(meta, set(names))) == len(names) + 1  # layers 0..2: layer_01 expected too
    bad = dict(missing_or_short(str(tmp_path), layout_of(meta), None))
    assert bad == {"zero_pp_rank_1_mp_rank_01_optim_states.pt": "is empty (0 bytes)",
                   "layer_01-model_00-model_states.pt": "is missing"}


def test_checkpoint_size_and_low_space_warning(monkeypatch, capsys, tmp_path):
    from megatron.arguments import parse_args, run_config_from_args
    from megatron.preflight import check_save_space

    argv = GPT_H32.flags() + ["--lr", "1e-3", "--train-iters", "2", "--mock-data", "--save", str(tmp_path)]
    args = parse_args(argv)
    run = run_config_from_args(args, 1, 200)
    # Hand count of this GPT-2 shape (vocab 200 padded to 256, 16 positions, h 32, ffn 128, tied output):
    h, v, layers = 32, 256, 2
    per_layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (4 * h * h + 4 * h) + (4 * h * h + h)
    params = v * h + 16 * h + layers * per_layer + 2 * h
    assert run.model.num_parameters(1) == params
    assert space.checkpoint_bytes(run) == params * (4 + 8)  # fp32 ZeRO-0: weights + Adam m, v
    assert space.checkpoint_bytes(run, with_optimizer=False) == params * 4
    monkeypatch.setattr(space, "free_bytes", lambda path: 1000)
    check_save_space(run.checkpoint, run)
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"> WARNING: --save {tmp_path}: its file system has 1,000 bytes") and "needs about" in out
    monkeypatch.setattr(space, "free_bytes", lambda path: 10**12)
    check_save_space(run.checkpoint, run)
    assert capsys.readouterr().out == ""
