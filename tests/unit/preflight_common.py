"""Run pretrain_gpt.py's main in-process as a single rank whose process group must never be created: every
error the pre-flight checks own has to come out of ``run_cli`` as one line, exit 2, before that point."""

from __future__ import annotations

import pretrain_gpt
from megatron.errors import run_cli
from tests.models import CONFIG_GPT_H64

BASE = CONFIG_GPT_H64 + ["--log-interval", "1", "--eval-iters", "0"]


class ReachedProcessGroup(Exception):
    """Raised instead of creating the process group: the checks under test let the run through."""


def with_flag(argv: list[str], flag: str, value: str | None = None) -> list[str]:
    """``argv`` with ``flag`` replaced (or appended); ``value`` None: a switch."""
    argv = list(argv)
    if flag in argv:
        i = argv.index(flag)
        del argv[i:i + 2]
    return argv + [flag] + ([value] if value is not None else [])


def run_until_process_group(argv, monkeypatch, capsys, world_size: int = 1, rank: int = 0,
                            local_world_size: int | None = None):
    """(exit code or None when the run reached the process group, stderr, stdout)."""
    import megatron.initialize

    for k, v in dict(RANK=rank, WORLD_SIZE=world_size, LOCAL_RANK=rank,
                     LOCAL_WORLD_SIZE=local_world_size or world_size,
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=29557).items():
        monkeypatch.setenv(k, str(v))

    def refuse(*args, **kwargs):
        raise ReachedProcessGroup

    monkeypatch.setattr(megatron.initialize, "initialize_megatron", refuse)
    try:
        rc = run_cli(pretrain_gpt.main, argv)
    except ReachedProcessGroup:
        rc = None
    out = capsys.readouterr()
    return rc, out.err.strip(), out.out


def assert_one_line_error(rc, err: str, out: str, *needles: str) -> None:
    assert rc == 2, (rc, err)
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    for late in ("iteration", "DeepSpeed engine", "built GPTModel"):  # nothing expensive ran before it
        assert late not in out, out
