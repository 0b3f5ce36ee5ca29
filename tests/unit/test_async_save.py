"""--async-save pieces in one process: the host copy is a snapshot that serializes to the original's bytes, a copy
that host memory cannot hold falls back to a synchronous write (one line), the save's state rides in the one flags
all-reduce and ``latest`` moves only after every rank reported its files durable, a failed background write is the
synchronous save's one line with ``latest`` unmoved, and retention never deletes ``latest``'s checkpoint or the save
in flight."""

import errno
import io
import json
import os
import zipfile
from collections import OrderedDict

import pytest
import torch

from megatron.checkpointing.live import async_save, commit, integrity
from megatron.checkpointing.live.async_save import AsyncSaver, PendingSave, RecordingCheckpointEngine
from megatron.checkpointing.live.host_copy import HostCopier
from megatron.checkpointing.live.safe_io import SafeCheckpointEngine
from megatron.core import comm
from megatron.errors import CheckpointError
from tests.models import CONFIG_GPT, replaced

ONE_SAMPLE = replaced(CONFIG_GPT, {"--global-batch-size": "1"})


class _Scaler:
    """A plain object inside a state (as DeepSpeed's loss scaler): the copy must not follow later changes."""

    def __init__(self) -> None:
        self.cur_scale = 1.0


def _records(state) -> dict[str, bytes]:
    """torch.save's zip records, less the per-save random serialization id."""
    buf = io.BytesIO()
    torch.save(state, buf)
    with zipfile.ZipFile(buf) as z:
        return {n: z.read(n) for n in z.namelist() if not n.endswith("serialization_id")}


def _state() -> dict:
    flat = torch.arange(24, dtype=torch.float32)
    return {"module": OrderedDict(w=flat[:12].view(3, 4), b=flat[20:]),  # views of one flat buffer
            "optimizer": {"state": {0: {"exp_avg": torch.randn(5), "step": torch.tensor(3.0)}},
                          "param_groups": [{"lr": 1e-3, "params": [0]}]},
            "alias": flat[::2], "param": torch.nn.Parameter(torch.ones(2)), "scaler": _Scaler(),
            "shape": torch.Size([3, 4]), "ids": (1, "x"), "iteration": 7}


def test_host_copy_serializes_to_the_same_bytes_and_is_a_snapshot():
    state = _state()
    want = _records(state)
    copy = HostCopier().copy(state, "mp_rank_00_model_states.pt")
    assert _records(copy) == want  # views, aliases, Parameter, dtypes: the file a synchronous save writes
    assert copy["module"]["w"].untyped_storage()._cdata == copy["alias"].untyped_storage()._cdata  # still shared
    assert copy["module"]["w"].untyped_storage()._cdata != state["module"]["w"].untyped_storage()._cdata
    assert isinstance(copy["param"], torch.nn.Parameter) and isinstance(copy["module"], OrderedDict)
    # Training goes on: the live state changes in place; the copy does not.
    state["module"]["w"].add_(1.0)
    state["optimizer"]["state"][0]["exp_avg"].zero_()
    state["optimizer"]["param_groups"][0]["lr"] = 5.0
    state["scaler"].cur_scale = 0.5
    assert _records(copy) == want
    assert HostCopier.bytes_of(state) == 24 * 4 + 5 * 4 + 4 + 2 * 4  # the flat buffer once


def test_recorder_copies_or_falls_back_to_a_synchronous_write(tmp_path, monkeypatch, capsys):
    like = SafeCheckpointEngine(None)
    rec = RecordingCheckpointEngine(like, HostCopier(), ranks_per_node=8, rank=3)
    path = str(tmp_path / "a.pt")
    state = {"w": torch.randn(1000)}
    monkeypatch.setattr(async_save, "host_available_bytes", lambda: 64 << 30)
    rec.save(state, path)
    assert not os.path.exists(path) and len(rec.items) == 1 and rec.host_bytes == 4000  # copied, nothing written
    monkeypatch.setattr(async_save, "host_available_bytes", lambda: (1 << 30) + 8 * 4000 - 1)  # reserve: 1 GiB
    monkeypatch.setattr(async_save, "host_total_bytes", lambda: 4 << 30)
    path2 = str(tmp_path / "b.pt")
    rec.save(state, path2)
    assert os.path.exists(path2) and len(rec.items) == 1 and rec.synchronous  # written now, hashed as ever
    assert "b.pt" in integrity.recorded(str(tmp_path))
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"> --async-save: rank 3: host memory cannot hold the copy of {path2} "
                                               "(4,000 bytes (0.00 GiB) x 8 ranks per node"), out
    assert out[0].endswith("this rank writes this save synchronously")
    rec.save(state, str(tmp_path / "c.pt"))  # the rest of this save stays synchronous, without another line
    assert os.path.exists(tmp_path / "c.pt") and capsys.readouterr().out == ""


def _one_rank(monkeypatch, tmp_path, keep_last=None):
    """A saver on a single rank: the all-reduce is the identity, and a run config with --save."""
    from megatron.arguments import parse_args, run_config_from_args

    sent = []
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 1)
    monkeypatch.setattr(comm, "reduce_host", lambda values, *a, **k: sent.append(list(values)) or list(values))
    monkeypatch.setattr(comm, "all_gather_object", lambda obj, *a, **k: [obj])
    argv = ONE_SAMPLE + ["--save", str(tmp_path), "--async-save"]
    if keep_last:
        argv += ["--keep-last-n-checkpoints", str(keep_last)]
    return run_config_from_args(parse_args(argv), 1, 200), sent


def _launch(saver: AsyncSaver, tmp_path, iteration: int, tensor: torch.Tensor) -> PendingSave:
    tag = f"global_step{iteration}"
    tmp_tag = f"{tag}.tmp-{iteration:x}"
    os.makedirs(tmp_path / tmp_tag)
    rec = saver.recorder(SafeCheckpointEngine(None))
    rec.save({"w": tensor}, str(tmp_path / tmp_tag / "mp_rank_00_model_states.pt"))
    pending = PendingSave(tag, tmp_tag, iteration, {"iteration": iteration}, free=None)
    saver.launch(pending, rec)
    return pending


def test_latest_moves_only_after_every_rank_reported_its_files_durable(tmp_path, monkeypatch):
    from megatron.resilience.control import RunControl

    run, sent = _one_rank(monkeypatch, tmp_path)
    saver = AsyncSaver(run)
    gate = __import__("threading").Event()
    write = integrity.write_torch
    monkeypatch.setattr(integrity, "write_torch", lambda *a, **k: gate.wait(30) and write(*a, **k))
    w = torch.arange(4.0)
    _launch(saver, tmp_path, 2, w)
    w.add_(10.0)  # the next step changes the weights while the writer waits
    control = RunControl(None, None, None, max_nonfinite=3, saving=True, saver=saver)
    try:
        flags = control.exchange(1.0)
        assert flags.save_state == (1.0, 0.0)  # busy: this rank's writer has not finished
        control.decide(1, flags)
        assert not os.path.exists(tmp_path / "latest") and saver.in_flight
        assert saver.drain_estimate_s() is None  # nothing written yet: no rate to predict the drain from
        gate.set()
        saver._join()
        flags = control.exchange(1.0)
        assert flags.save_state == (0.0, 0.0)
        control.decide(2, flags)  # every rank durable: rank 0's thread commits
        saver._join()
        control.decide(3, control.exchange(1.0))
    finally:
        control.close()
    assert not saver.in_flight and open(tmp_path / "latest").read() == "global_step2"
    assert saver.drain_estimate_s() == 0.0
    # [1:]: the first save's size; then one all-reduce per iteration: 5 flags, [busy, errno] and the drain estimate
    assert [len(v) for v in sent[1:]] == [8, 8, 8]
    step2 = tmp_path / "global_step2"
    assert sorted(os.listdir(step2)) == ["integrity.json", "megatron_meta.json", "mp_rank_00_model_states.pt"]
    assert torch.equal(torch.load(step2 / "mp_rank_00_model_states.pt")["w"], torch.arange(4.0))  # the snapshot
    manifest = json.load(open(step2 / "integrity.json"))["files"]
    assert sorted(manifest) == ["megatron_meta.json", "mp_rank_00_model_states.pt"]
    assert integrity.check_file(str(step2), "mp_rank_00_model_states.pt", manifest["mp_rank_00_model_states.pt"],
                                "full") is None


def test_failed_background_write_is_one_line_and_latest_stays(tmp_path, monkeypatch):
    run, _ = _one_rank(monkeypatch, tmp_path)
    saver = AsyncSaver(run)
    _launch(saver, tmp_path, 2, torch.ones(3))
    saver.finish("before exiting")
    assert open(tmp_path / "latest").read() == "global_step2"

    def full(obj, path, zipfile=True):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(integrity, "write_torch", full)
    pending = _launch(saver, tmp_path, 4, torch.ones(3))
    saver._join()
    assert saver.status() == [0.0, float(errno.ENOSPC)]
    with pytest.raises(CheckpointError) as err:
        saver.on_agreed(saver.status())
    msg = str(err.value)
    assert msg.startswith(f"checkpoint save to {tmp_path} failed: out of space (ENOSPC, writing "
                          f"{tmp_path / pending.tmp_tag / 'mp_rank_00_model_states.pt'} on rank 0)"), msg
    assert "'latest' still names global_step2" in msg and "\n" not in msg
    assert open(tmp_path / "latest").read() == "global_step2" and not saver.in_flight
    assert sorted(os.listdir(tmp_path)) == ["global_step2", "latest", "latest_checkpointed_iteration.txt"]


def test_retention_keeps_latest_and_the_save_in_flight(tmp_path, monkeypatch):
    for name in ("global_step2", "global_step4", "global_step6", "global_step8.tmp-1", "global_step9.tmp-2"):
        os.makedirs(tmp_path / name)
    (tmp_path / "latest").write_text("global_step2")  # e.g. a user pointed it back at an older one
    assert commit.leftovers(str(tmp_path)) == ["global_step8.tmp-1", "global_step9.tmp-2"]
    commit.retain(str(tmp_path), keep_last=1, current_tmp="global_step9.tmp-2")
    assert sorted(os.listdir(tmp_path)) == ["global_step2", "global_step6", "global_step9.tmp-2", "latest"]


def test_flag_and_deepspeed_writer_keys(tmp_path):
    """--async-save needs --save; DeepSpeed's JSON writers (which our hashing writer would bypass) are refused
    naming --async-save, an off value passes."""
    import json as _json

    from megatron.arguments import parse_args, run_config_from_args
    from megatron.engine import build_ds_config
    from megatron.errors import ConfigError

    base = ONE_SAMPLE
    with pytest.raises(ConfigError, match="^--async-save without --save: nothing would be saved"):
        run_config_from_args(parse_args(base + ["--async-save"]), 1, 200)
    run = run_config_from_args(parse_args(base + ["--async-save", "--save", str(tmp_path)]), 1, 200)
    assert run.checkpoint.async_save
    path = tmp_path / "ds.json"

    def run_with(cfg):  # the same flags with a --deepspeed_config
        path.write_text(_json.dumps(cfg))
        return run_config_from_args(parse_args(base + ["--async-save", "--save", str(tmp_path), "--deepspeed_config",
                                                       str(path)]), 1, 200)

    for cfg, key in (({"checkpoint": {"writer": {"type": "fast", "decoupled": True}}}, "checkpoint.writer"),
                     ({"datastates_ckpt": {"enabled": True}}, "datastates_ckpt")):
        with pytest.raises(ConfigError, match=f"{key}: .*pass --async-save"):
            run_with(cfg)
    assert "writer" not in build_ds_config(run_with({"checkpoint": {"writer": None}}))["checkpoint"]
