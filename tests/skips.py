"""Skip accounting for tests/run.sh: a pytest plugin that records why each test was skipped, and a check that fails
on a skip outside tests/gpu whose reason is not on tests/skip_allowlist.txt.

    python -m pytest -p tests.skips --skip-report skips.json ...
    python -m tests.skips skips.json tests/skip_allowlist.txt
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass

import pytest

GPU_SUITE = "tests/gpu/"


def pytest_addoption(parser):
    parser.addoption("--skip-report", default=None, metavar="PATH",
                     help="write every skip (test id and reason) to PATH as JSON (tests/run.sh checks it)")


class _Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self.skips: list[dict[str, str]] = []

    def _add(self, report) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return  # an xfail is reported as skipped too; it is no skip
        # A skip's longrepr is (file, line, "Skipped: reason").
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        self.skips.append({"test": report.nodeid, "reason": reason.removeprefix("Skipped: ")})

    def pytest_runtest_logreport(self, report) -> None:
        self._add(report)

    def pytest_collectreport(self, report) -> None:  # a whole module skipped while collected (importorskip)
        self._add(report)

    def pytest_sessionfinish(self, session) -> None:
        # tests/run.sh runs pytest twice (the parallel phase, then the serial one) into one report: append.
        try:
            with open(self.path) as f:
                earlier = json.load(f)
        except (OSError, ValueError):
            earlier = []
        with open(self.path, "w") as f:
            json.dump(earlier + self.skips, f, indent=1)


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    path = config.getoption("--skip-report")
    if path and not hasattr(config, "workerinput"):  # under pytest-xdist the controller sees every worker's reports
        config.pluginmanager.register(_Recorder(path), "skip-recorder")


@dataclass(frozen=True)
class Allowed:
    reason: str  # a skip's reason must start with this
    why: str


def read_allowlist(path: str) -> list[Allowed]:
    """Entries are "reason: <prefix of the skip reason>" followed by "why: <why a CPU run may skip it>"."""
    entries, reason = [], None
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition(":")
            value = value.strip()
            if key == "reason" and reason is None and value:
                reason = value
            elif key == "why" and reason is not None and value:
                entries.append(Allowed(reason, value))
                reason = None
            else:
                raise ValueError(f"{path}:{n}: expected 'reason: ...' then 'why: ...', got {line!r}")
    if reason is not None:
        raise ValueError(f"{path}: the entry for {reason!r} gives no 'why: ...'")
    return entries


def check(skips: list[dict[str, str]], allowed: list[Allowed]) -> tuple[str, int]:
    """The summary (skips grouped by reason, most frequent first) and how many skips are not allowed."""
    groups: dict[tuple[bool, str], list[str]] = defaultdict(list)
    for s in skips:
        gpu = s["test"].startswith(GPU_SUITE)
        ok = gpu or any(s["reason"].startswith(a.reason) for a in allowed)
        groups[(ok, "tests/gpu: " + s["reason"] if gpu else s["reason"])].append(s["test"])
    lines, bad = [f"skips by reason ({len(skips)} in all):"], 0
    for (ok, reason), tests in sorted(groups.items(), key=lambda kv: (kv[0][0], -len(kv[1]), kv[0][1])):
        lines.append(f"  {len(tests):4d}  {'' if ok else 'NOT ALLOWED: '}{reason}")
        if not ok:
            bad += len(tests)
            lines += [f"          {t}" for t in tests[:5]] + ([f"          ... {len(tests) - 5} more"]
                                                              if len(tests) > 5 else [])
    return "\n".join(lines), bad


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m tests.skips SKIP_REPORT.json [SKIP_REPORT.json ...] ALLOWLIST", file=sys.stderr)
        return 2
    try:
        skips = []
        for path in argv[:-1]:  # tests/run.sh's campaign phase writes its own report beside the parallel phase's
            with open(path) as f:
                text = f.read()
            skips += json.loads(text) if text.strip() else []
        allowed = read_allowlist(argv[-1])
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary, bad = check(skips, allowed)
    print(summary)
    if bad:
        print(f"error: {bad} test(s) outside tests/gpu skipped for a reason not in {argv[1]}: make them run, or add "
              "the reason there with why a CPU run may skip it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
