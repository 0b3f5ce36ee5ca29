"""tests/skips.py, the skip accounting of tests/run.sh: the plugin records each skip with its reason (collection
skips too, xfails not), and the check fails on a reason outside tests/gpu that tests/skip_allowlist.txt lacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.launch import REPO
from tests.skips import Allowed, check, read_allowlist

SCRATCH = '''
import pytest
def test_runs():
    pass
def test_new_reason():
    pytest.skip("a reason nobody allowed")
@pytest.mark.skip(reason="listed: the start of this reason is allowed")
def test_listed():
    pass
@pytest.mark.xfail(reason="expected to fail")
def test_xfail():
    assert False
'''


def test_plugin_records_every_skip_with_its_reason(tmp_path):
    (tmp_path / "test_scratch.py").write_text(SCRATCH)
    (tmp_path / "test_module_skip.py").write_text('import pytest\npytest.importorskip("no_such_module_xyz")\n')
    report = tmp_path / "skips.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.skips",
                           "--skip-report", str(report), "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = {s["test"]: s["reason"] for s in json.loads(report.read_text())}
    assert got == {"test_scratch.py::test_new_reason": "a reason nobody allowed",
                   "test_scratch.py::test_listed": "listed: the start of this reason is allowed",
                   "test_module_skip.py": "could not import 'no_such_module_xyz': No module named 'no_such_module_xyz'"}


def test_check_fails_on_a_reason_not_allowed_and_groups_by_reason():
    allowed = [Allowed("listed:", "a test of the check")]
    skips = [{"test": "tests/unit/a.py::t1", "reason": "listed: one"},
             {"test": "tests/gpu/b.py::t2", "reason": "needs a GPU"},
             {"test": "tests/gpu/b.py::t3", "reason": "needs a GPU"}]
    summary, bad = check(skips, allowed)
    assert bad == 0 and "   2  tests/gpu: needs a GPU" in summary and "   1  listed: one" in summary
    summary, bad = check(skips + [{"test": "tests/unit/c.py::t4", "reason": "new"}], allowed)
    assert bad == 1 and "NOT ALLOWED: new" in summary and "tests/unit/c.py::t4" in summary


def test_allowlist_entries_name_why(tmp_path):
    entries = read_allowlist(os.path.join(REPO, "tests", "skip_allowlist.txt"))
    assert entries and all(e.reason and e.why for e in entries)
    bad = tmp_path / "list.txt"
    bad.write_text("reason: something\n")
    with pytest.raises(ValueError, match="gives no 'why"):
        read_allowlist(str(bad))
