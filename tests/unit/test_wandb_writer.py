"""W&B without a launch, on a stand-in ``wandb`` module: TensorBoard's series on the iteration's step or a custom axis
(upstream's Samples/Tokens), the mode chosen without waiting (no key, WANDB_MODE, an unreachable host, a failed
online start), one run id per campaign folder, the writer on the last rank only, and the flags' one-line refusals.
tests/functional/test_wandb_offline.py runs the real library."""

from __future__ import annotations

import socket
import sys
import time
import types

import pytest

from megatron.arguments.configs import log_options_from_args
from megatron.arguments.parser import parse_args
from megatron.config.log import LogOptions
from megatron.errors import ConfigError
from megatron.training import tensorboard as tb
from megatron.training import wandb_writer as ww
from megatron.training.writers import ScalarWriters
from tests.models import CONFIG_GPT


class FakeRun:
    def __init__(self, **kw) -> None:
        self.kw, self.id, self.logged, self.defined, self.finished = kw, kw["id"], [], [], False
        self.settings = types.SimpleNamespace(mode=kw.get("mode") or "online")

    def log(self, data: dict, step: int) -> None:
        self.logged.append((step, data))

    def define_metric(self, name: str, **kw) -> None:
        self.defined.append((name, kw))

    def finish(self) -> None:
        self.finished = True


class FakeWandb(types.ModuleType):
    """What wandb_writer calls of the library, recorded."""

    def __init__(self, key: bool = False, base_url: str = "https://api.example:443", fail_online: bool = False):
        super().__init__("wandb")
        self.key, self.base_url, self.fail_online = key, base_url, fail_online
        self.runs, self.torn_down = [], False

    def login(self, prompt: bool, verify: bool) -> bool:
        assert prompt is False and verify is False  # never a prompt, never the network
        return self.key

    def Settings(self, **kw):  # noqa: N802 - the library's name
        return types.SimpleNamespace(base_url=self.base_url, **kw)

    def init(self, **kw) -> FakeRun:
        if self.fail_online and kw["mode"] == "online":
            raise RuntimeError("CommError: Run initialization has timed out after 60.0 sec.")
        self.runs.append(FakeRun(**kw))
        return self.runs[-1]

    def teardown(self) -> None:
        self.torn_down = True

    @staticmethod
    def Histogram(values):  # noqa: N802
        return ("histogram", list(values))


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(v, raising=False)
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    return wandb


def _opts(tmp_path, **kw) -> LogOptions:
    return LogOptions(**{"wandb_project": "p", "wandb_exp_name": "e", "wandb_dir": str(tmp_path / "wb"), **kw})


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_series_on_the_iteration_or_on_upstreams_custom_axes(fake, tmp_path):
    run = FakeRun(id="x")
    writer = ww.WandbWriter(fake, run, _opts(tmp_path), offline=True)
    for it in (2, 3):
        writer.set_iteration(it)
        tb.write_training(writer, _opts(tmp_path), it, 8 * it, 128 * it, loss=5.0 - it, lr=1e-3, batch_size=8,
                          loss_scale=None, world_size=1, grad_norm=0.5, params_norm=None)
    writer.add_histogram("stragglers/own work vs median", [1.0, 2.0], 3)
    steps = [s for s, _ in run.logged]
    assert steps == sorted(steps) and set(steps) == {2, 3}  # never below the last step: W&B would drop it
    at3 = {k: v for s, d in run.logged if s == 3 for k, v in d.items()}
    assert at3["lm-loss-training/lm loss"] == 2.0
    assert at3["lm-loss-training/lm loss vs samples"] == 2.0 and at3["Samples"] == 24  # TB's step is the axis
    assert at3["lm-loss-training/lm loss vs tokens"] == 2.0 and at3["Tokens"] == 384
    assert at3["steps-vs-samples/y=steps,x=samples"] == 3 and at3["steps-vs-samples/y=samples,x=steps"] == 24
    assert at3["stragglers/own work vs median"] == ("histogram", [1.0, 2.0])
    custom = {"lm-loss-training/lm loss vs samples": "Samples", "steps-vs-tokens/y=steps,x=tokens": "Tokens"}
    for name, axis in custom.items():  # defined once each, against their axis
        assert [kw for n, kw in run.defined if n == name] == [{"step_metric": axis}]
    assert [n for n, kw in run.defined if not kw] == ["Samples", "Tokens"]
    assert ww.custom_axis("steps-vs-tokens/y=tokens,x=steps") is None


def test_mode_never_waits(fake, monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("no connection may be tried")

    monkeypatch.setattr(socket, "create_connection", no_network)
    assert ww.choose_mode(fake) == ("offline", "no W&B API key (WANDB_API_KEY or `wandb login`)")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert ww.choose_mode(FakeWandb(key=True)) == (None, "WANDB_MODE=disabled")  # wandb's own choice


def test_unreachable_host_goes_offline_within_seconds(monkeypatch):
    for v in ("WANDB_MODE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(v, raising=False)
    port = _closed_port()
    t0 = time.monotonic()
    mode, why = ww.choose_mode(FakeWandb(key=True, base_url=f"http://127.0.0.1:{port}"))
    assert (mode, why.split(" (")[0]) == ("offline", f"127.0.0.1:{port} unreachable")
    assert time.monotonic() - t0 < 4
    with socket.create_server(("127.0.0.1", 0)) as server:  # a host that answers: online
        assert ww.choose_mode(FakeWandb(key=True, base_url=f"http://127.0.0.1:{server.getsockname()[1]}")) == \
            ("online", "")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.olcf:3128")  # Frontier's way out: the proxy is what answers
    assert ww.probe_target("https://api.wandb.ai") == ("proxy.olcf", 3128)
    assert ww.probe_target("http://127.0.0.1:9") == ("127.0.0.1", 9)


def test_last_rank_writes_and_the_campaign_keeps_one_run_id(fake, tmp_path, capsys):
    opts = _opts(tmp_path)
    assert ww.open_wandb(opts, {}, rank=0, world_size=2) is None  # upstream's writer is on the last rank
    first = ww.open_wandb(opts, {"lr": 1e-3, "data_path": ["1", "a"], "obj": object()}, rank=1, world_size=2)
    kw = fake.runs[0].kw
    assert (kw["project"], kw["name"], kw["dir"], kw["mode"], kw["resume"]) == ("p", "e", opts.wandb_dir, "offline",
                                                                                 "allow")
    assert kw["config"] == {"lr": 1e-3, "data_path": ["1", "a"]} and kw["settings"].console == "off"
    second = ww.open_wandb(opts, {}, rank=0, world_size=1)  # the campaign's next job
    assert second.run.id == first.run.id and len(first.run.id) == 8
    other = ww.open_wandb(_opts(tmp_path, wandb_project="q"), {}, rank=0, world_size=1)
    assert other.run.id != first.run.id  # another project in the folder: another run
    out = capsys.readouterr().out
    assert f"> W&B run {first.run.id} (p, e): offline (no W&B API key" in out
    # The end: finish, and the command that syncs every job's offline folder into the one run.
    runs = tmp_path / "wb" / "wandb"
    for stamp in ("20260101_000000", "20260102_000000"):
        (runs / f"offline-run-{stamp}-{first.run.id}").mkdir(parents=True)
    (runs / f"run-20260103_000000-{first.run.id}").mkdir()  # a failed online start's folder: never synced
    first.close()
    assert first.run.finished
    line = capsys.readouterr().out.strip()
    assert line.endswith(f"wandb sync --id {first.run.id} -p p {runs}/offline-run-20260101_000000-{first.run.id} "
                         f"{runs}/offline-run-20260102_000000-{first.run.id}")


def test_failed_online_start_falls_back_offline_with_the_same_id(fake, tmp_path, monkeypatch):
    wandb = FakeWandb(key=True, fail_online=True)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setattr(ww, "choose_mode", lambda w: ("online", ""))
    writer = ww.open_wandb(_opts(tmp_path), {}, rank=0, world_size=1)
    assert wandb.torn_down and writer.offline and writer.run.kw["mode"] == "offline"
    assert writer.run.id == ww.campaign_run_id(str(tmp_path / "wb"), "p")


def test_scalar_writers_fan_out():
    class Rec:
        def __init__(self):
            self.got, self.closed, self.iteration = [], False, None

        def add_scalar(self, tag, value, step):
            self.got.append((tag, value, step))

        def add_histogram(self, tag, values, step):
            self.got.append((tag, list(values), step))

        def set_iteration(self, it):
            self.iteration = it

        def close(self):
            self.closed = True

    a, b = Rec(), Rec()
    writers = ScalarWriters(a, b)
    writers.set_iteration(7)
    writers.add_scalar("MFU", 1.5, 7)
    writers.add_histogram("h", [1.0], 7)
    writers.close()
    assert a.got == b.got == [("MFU", 1.5, 7), ("h", [1.0], 7)] and a.closed and b.closed
    assert b.iteration == 7 and a.iteration is None  # only W&B needs the iteration


def _log_options(argv):
    return log_options_from_args(parse_args(CONFIG_GPT + argv))


def test_flags(monkeypatch, tmp_path):
    opts = _log_options(["--wandb-project", "p", "--save", str(tmp_path)])
    assert opts.wandb and opts.wandb_dir == str(tmp_path / "wandb") and opts.writes_scalars  # upstream's default
    assert opts.tb_step(1) and not _log_options([]).tb_step(1)
    assert _log_options(["--wandb-exp-name", "e", "--wandb-save-dir", "d"]).wandb_dir == "d"  # either flag
    assert not _log_options(["--wandb-project", ""]).wandb  # upstream's '' is not given
    assert _log_options(["--wandb-save-dir", "d"]).notes == (
        "--wandb-save-dir without --wandb-project or --wandb-exp-name: no W&B run is started, as upstream",)
    with pytest.raises(ConfigError, match="--wandb-project / --wandb-exp-name need --wandb-save-dir DIR or --save "
                                          "DIR"):
        _log_options(["--wandb-project", "p"])
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"--wandb-exp-name needs the wandb package, not installed here: pip install "
                                          r"'megatron-frontier\[wandb\]'"):
        _log_options(["--wandb-exp-name", "e", "--save", str(tmp_path)])


def test_without_the_package_the_cli_names_the_extra(monkeypatch, capsys, tmp_path):
    """The package hidden (an import of it fails, as where it is not installed): pretrain_gpt.py stops before any
    process group with one line naming the extra."""
    from tests.unit.preflight_common import BASE, assert_one_line_error, run_until_process_group

    monkeypatch.setitem(sys.modules, "wandb", None)
    rc, err, out = run_until_process_group(BASE + ["--wandb-project", "p", "--save", str(tmp_path)], monkeypatch,
                                           capsys)
    assert_one_line_error(rc, err, out, "--wandb-project needs the wandb package", "pip install",
                          "'megatron-frontier[wandb]'", "-e '.[wandb]'")
