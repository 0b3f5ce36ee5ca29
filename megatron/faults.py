"""Faults injected for tests at one documented point: ``MEGATRON_FAULT`` names a rank, a phase, an iteration and what
this rank does there (docs/faults.md, "Injecting faults in tests"). Unset, nothing is armed and the progress record's
hooks cost one attribute check.

Grammar (``;`` separates faults, ``,`` the items of one)::

    MEGATRON_FAULT="rank=1,phase=backward,iteration=3,action=block"
    MEGATRON_FAULT="rank=0,phase=write,file=global_step4.tmp-,action=sleep:60;phase=step,action=sleep:0.3"

- ``phase`` (required): a phase the progress record enters (``step``, ``data``, ``forward``, ``backward``,
  ``optimizer``, ``log``, ``eval``, ``save``, ``load``, the pipeline's ``send activation``, ...), a collective's op
  (``all_reduce``, ``broadcast``, ``send``, ...: it fires inside the collective, once it is recorded as entered) or
  ``write`` (a checkpoint file opened for writing, on whichever thread writes it);
- ``rank``: the global rank (default: every rank); ``iteration``: ``N`` or ``N+`` (N and later; default: any);
  ``file``: for ``write``, a part of the file's path;
- ``action`` (required): ``block`` (the thread sleeps forever), ``sleep:S``, ``spin:S`` (computes S seconds),
  ``exit:CODE`` (``os._exit``), ``signal:NAME`` (to this process, e.g. ``signal:TERM``), ``oom`` (raises
  MemoryError), ``raise:ERRNO`` (raises that OSError, e.g. ``raise:ENOSPC``).

A fault fires every time its phase is entered where it matches; the first time it also prints one line to stderr.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from dataclasses import dataclass

from megatron.errors import ConfigError
from megatron.progress import Progress

ENV = "MEGATRON_FAULT"
ACTIONS = {"block": None, "sleep": float, "spin": float, "exit": int, "signal": str, "oom": None, "raise": str}
"""Action -> the type of its argument (None: it takes none)."""
KEYS = ("rank", "phase", "iteration", "file", "action")


@dataclass(frozen=True)
class Fault:
    """One fault: where it hits (phase, rank, iteration, file) and what it does (action and its argument)."""

    phase: str
    action: str
    arg: float | int | str | None = None
    rank: int | None = None
    """None: every rank."""
    iteration: int | None = None
    """None: any iteration."""
    onward: bool = False
    """``iteration=N+``: N and every later one."""
    file: str | None = None
    """``phase=write`` only: a part of the written file's path."""

    def matches(self, phase: str, rank: int, iteration: int, path: str | None) -> bool:
        if phase != self.phase or (self.rank is not None and rank != self.rank):
            return False
        if self.iteration is not None and not (iteration >= self.iteration if self.onward
                                               else iteration == self.iteration):
            return False
        return self.file is None or (path is not None and self.file in path)

    def what(self) -> str:
        """e.g. "blocks", "sleeps 4.0 s", "exits with code 7"."""
        return {"block": "blocks", "sleep": f"sleeps {self.arg} s", "spin": f"computes {self.arg} s",
                "exit": f"exits with code {self.arg}", "signal": f"sends itself SIG{self.arg}",
                "oom": "raises MemoryError", "raise": f"raises OSError {self.arg}"}[self.action]


class Faults:
    """The armed faults of one run (``Progress.faults``)."""

    def __init__(self, faults: tuple[Fault, ...]) -> None:
        self.faults = faults
        self.fired_at: float | None = None
        """time.time() when a fault first fired on this rank (a test's observer thread polls it)."""
        self._said: set[Fault] = set()

    def at(self, phase: str, progress: Progress, path: str | None = None) -> None:
        """``progress``'s thread enters ``phase`` (``path``: the file a ``write`` opens): run every fault that
        matches."""
        rank, iteration = progress.identity.rank, progress.position.iteration
        for fault in self.faults:
            if fault.matches(phase, rank, iteration, path):
                self._fire(fault, phase, progress, path)

    def _fire(self, fault: Fault, phase: str, progress: Progress, path: str | None) -> None:
        if self.fired_at is None:
            self.fired_at = time.time()
        if fault not in self._said:
            self._said.add(fault)
            where = f"{phase} of {path}" if path else phase
            print(f"> fault injected ({ENV}): {progress.identity} {fault.what()} in {where} at iteration "
                  f"{progress.position.iteration}", file=sys.stderr, flush=True)
        run(fault, path)


def run(fault: Fault, path: str | None = None) -> None:
    """Do what ``fault`` says, on this thread."""
    if fault.action == "block":
        _block()
    elif fault.action == "sleep":
        time.sleep(fault.arg)
    elif fault.action == "spin":  # compute, not sleep: the rank's own work is slower
        began = time.perf_counter()
        while time.perf_counter() - began < fault.arg:
            pass
    elif fault.action == "exit":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(fault.arg)
    elif fault.action == "signal":
        os.kill(os.getpid(), getattr(signal, f"SIG{fault.arg}"))
    elif fault.action == "oom":
        raise MemoryError(f"injected by {ENV}")
    else:
        code = getattr(errno, fault.arg)
        raise OSError(code, os.strerror(code), path)


def _block() -> None:
    """Forever, in this thread (the process's other threads, the watchdog's among them, live on)."""
    while True:
        time.sleep(1)


def parse(text: str) -> tuple[Fault, ...]:
    """The faults of a ``MEGATRON_FAULT`` value; a malformed one raises ConfigError naming the part and the form."""
    return tuple(_one(part.strip(), text) for part in text.split(";") if part.strip())


def _one(spec: str, text: str) -> Fault:
    def bad(why: str) -> ConfigError:
        return ConfigError(f"{ENV}={text!r}: {why}; the form is rank=R,phase=P,iteration=N[+],action=A[:ARG] "
                           f"(actions: {', '.join(ACTIONS)}; docs/faults.md)")

    items: dict[str, str] = {}
    for item in spec.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in KEYS:
            raise bad(f"{item.strip()!r} is not one of {', '.join(k + '=' for k in KEYS)}")
        items[key] = value.strip()
    if not items.get("phase") or not items.get("action"):
        raise bad(f"{spec!r} needs phase= and action=")
    action, _, arg = items["action"].partition(":")
    if action not in ACTIONS:
        raise bad(f"unknown action {action!r}")
    kind = ACTIONS[action]
    if (kind is None) == bool(arg):
        raise bad(f"action {action} takes {'no argument' if kind is None else 'an argument (' + action + ':X)'}")
    try:
        value = kind(arg) if kind is not None else None
        rank = int(items["rank"]) if items.get("rank", "*") != "*" else None
        it = items.get("iteration")
        iteration = int(it.rstrip("+")) if it else None
    except ValueError as e:
        raise bad(str(e)) from None
    if action == "signal" and not hasattr(signal, f"SIG{value}"):
        raise bad(f"no signal SIG{value}")
    if action == "raise" and not hasattr(errno, value):
        raise bad(f"no errno {value}")
    if "file" in items and items["phase"] != "write":
        raise bad("file= goes with phase=write")
    return Fault(items["phase"], action, value, rank, iteration, bool(it and it.endswith("+")), items.get("file"))


def from_environ(environ=os.environ) -> Faults | None:
    """The faults ``MEGATRON_FAULT`` names (read once, when a run starts); None when it is unset or empty."""
    text = environ.get(ENV, "").strip()
    return Faults(parse(text)) if text else None
