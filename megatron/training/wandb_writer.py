"""Weights & Biases with the real wandb library (the optional extra: pip install '.[wandb]'), as upstream
Megatron-DeepSpeed's --wandb-project / --wandb-exp-name / --wandb-save-dir: one writer on the last rank, the run's
flags as its config, the TensorBoard series under the same names and steps.

A compute node often cannot reach the service (Frontier's reach it through a proxy at best): without an API key, or
when the service's host does not answer a TCP connect within seconds, the run is written offline at once (never a
90 s wait in wandb.init), and the `wandb sync` command that uploads it is printed at the end. A campaign's jobs share
one W&B run id, kept in the W&B folder (``wandb_run.json``); offline runs cannot resume, so each job writes its own
``offline-run-*-<id>`` folder and the printed command syncs them, in order, into that one run.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import socket
import string
import time
from urllib.parse import urlparse

from megatron.config.log import LogOptions

RUN_ID_FILE = "wandb_run.json"
PROBE_TIMEOUT_S = 3.0
"""How long the service's host may take to accept a TCP connection before the run goes offline."""
ONLINE_INIT_TIMEOUT_S = 60.0
"""wandb.init's own timeout once the host answered (its default is 90 s)."""
CUSTOM_AXES = {" vs samples": "Samples", "steps-vs-samples/y=steps,x=samples": "Samples",
               " vs tokens": "Tokens", "steps-vs-tokens/y=steps,x=tokens": "Tokens"}
"""TensorBoard tags whose step is not the iteration (suffix or whole tag) -> the W&B axis their step becomes, as
upstream's interop logger: the value is logged against that axis, at the current iteration's W&B step."""


def open_wandb(opts: LogOptions, flags: dict, rank: int, world_size: int) -> WandbWriter | None:
    """The W&B writer on the last rank (upstream's), when --wandb-project or --wandb-exp-name is given."""
    if not opts.wandb or rank != world_size - 1:
        return None
    # Imported only here: wandb is an optional extra (configure() refused the flags without it) and brings its own
    # service process; no other rank or run pays for it.
    import wandb

    os.makedirs(opts.wandb_dir, exist_ok=True)
    run_id = campaign_run_id(opts.wandb_dir, opts.wandb_project)
    mode, why = choose_mode(wandb)
    kwargs = dict(project=opts.wandb_project, name=opts.wandb_exp_name, dir=opts.wandb_dir, id=run_id,
                  resume="allow", config=plain_config(flags))
    t0 = time.monotonic()
    try:
        run = wandb.init(**kwargs, mode=mode, settings=_settings(wandb))
    except Exception as e:  # noqa: BLE001 - any failure to start online (auth, network, server) falls back offline
        if mode == "offline":
            raise
        wandb.teardown()  # else the second init finds the failed run's id "in use"
        mode, why = "offline", f"the online start failed: {str(e).splitlines()[0][:200]}"
        run = wandb.init(**kwargs, mode=mode, settings=_settings(wandb))
    shown = mode or os.environ.get("WANDB_MODE", "online")
    print(f"> W&B run {run_id} ({opts.wandb_project or 'default project'}"
          f"{', ' + opts.wandb_exp_name if opts.wandb_exp_name else ''}): {shown}{f' ({why})' if why else ''}, "
          f"started in {time.monotonic() - t0:.1f} s, files in {opts.wandb_dir}", flush=True)
    return WandbWriter(wandb, run, opts, offline=run.settings.mode == "offline")


class WandbWriter:
    """The subset of TensorBoard's SummaryWriter the loop uses, writing to one W&B run."""

    def __init__(self, wandb, run, opts: LogOptions, offline: bool) -> None:
        self.wandb, self.run, self.opts, self.offline = wandb, run, opts, offline
        self.iteration = 0
        """The W&B step of series logged against a custom axis (set by the loop before it writes)."""
        self._defined: set[str] = set()

    def set_iteration(self, it: int) -> None:
        self.iteration = it

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        axis = custom_axis(tag)
        if axis is None:
            self.run.log({tag: value}, step=step)
            return
        for name, kw in ((axis, {}), (tag, {"step_metric": axis})):
            if name not in self._defined:
                self.run.define_metric(name, **kw)
                self._defined.add(name)
        self.run.log({tag: value, axis: step}, step=self.iteration)

    def add_histogram(self, tag: str, values, step: int) -> None:
        import numpy as np

        self.run.log({tag: self.wandb.Histogram(np.asarray(values))}, step=step)

    def add_text(self, *args, **kwargs) -> None:
        """The flags are the run's config already."""

    def close(self) -> None:
        self.run.finish()
        if self.offline:
            print(f"> W&B run {self.run.id} written offline; upload it (every job of the run, in order) with: "
                  f"{sync_command(self.opts.wandb_dir, self.run.id, self.opts.wandb_project)}", flush=True)


def write_throughput(writer: WandbWriter, it: int, *, seconds: float, samples_per_sec: float, seq_length: int,
                     dp: int, world: int, tflops: float, parameters: int, losses: tuple[float, float | None]) -> None:
    """Upstream's W&B-only series at --log-interval (its training_log): throughput/* over the interval's mean
    iteration and loss/<key> of this iteration. throughput/elapsed_ms_per_iteration is in milliseconds here
    (upstream logs seconds under that name)."""
    tokens = samples_per_sec * seq_length
    for name, value in (("iteration-time", seconds), ("samples_per_sec", samples_per_sec),
                        ("samples_per_sec_per_replica", samples_per_sec / dp), ("tokens_per_sec", tokens),
                        ("tokens_per_sec_per_replica", tokens / dp), ("tokens_per_gpu_per_sec", tokens / world),
                        ("tokens_per_gpu_per_sec_per_replica", tokens / world / dp), ("tflops", tflops),
                        ("approx_params_in_billions", parameters / 1e9),
                        ("elapsed_ms_per_iteration", seconds * 1e3)):
        writer.add_scalar(f"throughput/{name}", value, it)
    lm, moe = losses
    writer.add_scalar("loss/lm loss", lm, it)
    if moe is not None:
        writer.add_scalar("loss/moe loss", moe, it)


def custom_axis(tag: str) -> str | None:
    for ending, axis in CUSTOM_AXES.items():
        if tag.endswith(ending):
            return axis
    return None


def choose_mode(wandb) -> tuple[str | None, str]:
    """(mode for wandb.init, why): WANDB_MODE set -> None (wandb's own); no API key -> offline; the service's host
    (or the HTTPS proxy's) not answering within PROBE_TIMEOUT_S -> offline; else online. Nothing here waits long."""
    if os.environ.get("WANDB_MODE"):
        return None, f"WANDB_MODE={os.environ['WANDB_MODE']}"
    if not wandb.login(prompt=False, verify=False):  # the key from the environment or ~/.netrc; no network
        return "offline", "no W&B API key (WANDB_API_KEY or `wandb login`)"
    host, port = probe_target(wandb.Settings().base_url)
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as e:
        return "offline", f"{host}:{port} unreachable ({e.strerror or e})"
    return "online", ""


def probe_target(base_url: str) -> tuple[str, int]:
    """The host and port a connection to ``base_url`` opens first: the HTTPS (or HTTP) proxy's when one is set."""
    url = urlparse(base_url)
    proxy = os.environ.get(f"{url.scheme.upper()}_PROXY") or os.environ.get(f"{url.scheme}_proxy")
    target = urlparse(proxy if "://" in (proxy or "") else f"http://{proxy}") if proxy else url
    return target.hostname or "localhost", target.port or (443 if target.scheme == "https" else 80)


def _settings(wandb):
    """console off: wandb never wraps our stdout (log parsers read it); quiet: our line says where the run went."""
    return wandb.Settings(console="off", quiet=True, init_timeout=ONLINE_INIT_TIMEOUT_S)


def campaign_run_id(wandb_dir: str, project: str | None) -> str:
    """The run id every job of this campaign logs to: kept in ``wandb_dir/wandb_run.json`` with its project; a new
    one (8 characters of [a-z0-9], as wandb's) for a new folder or another project."""
    path = os.path.join(wandb_dir, RUN_ID_FILE)
    try:
        with open(path) as f:
            kept = json.load(f)
        if kept.get("project") == project and kept.get("id"):
            return str(kept["id"])
    except (OSError, ValueError):
        pass
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"id": run_id, "project": project}, f)
    os.replace(tmp, path)
    return run_id


def offline_folders(wandb_dir: str, run_id: str) -> list[str]:
    """Every job's offline folder of this run, oldest first (their names start with the start time)."""
    return sorted(glob.glob(os.path.join(wandb_dir, "wandb", f"offline-run-*-{run_id}")))


def sync_command(wandb_dir: str, run_id: str, project: str | None) -> str:
    project_flag = f" -p {project}" if project else ""
    return f"wandb sync --id {run_id}{project_flag} {' '.join(offline_folders(wandb_dir, run_id))}"


def plain_config(flags: dict) -> dict:
    """The parsed flags as W&B config values (numbers, strings, lists of them)."""
    def plain(v):
        return v is None or isinstance(v, (bool, int, float, str))

    return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in flags.items()
            if plain(v) or (isinstance(v, (list, tuple)) and all(plain(x) for x in v))}
