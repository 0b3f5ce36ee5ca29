"""README.md and docs/*.md: every relative link and #anchor resolves (GitHub's heading slugs), the README stays short
with the Frontier quick start second, and the doc anchors named in code exist."""

from __future__ import annotations

import glob
import os
import re
import unicodedata

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README_MAX_LINES = 250
FRONTIER_BEFORE_LINE = 60

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
_HTML_HREF = re.compile(r"<a\s[^>]*href=[\"']([^\"']+)[\"']", re.I)
_HTML_ID = re.compile(r"<a\s[^>]*(?:id|name)=[\"']([^\"']+)[\"']", re.I)
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")
# "docs/x.md#anchor" or "README.md#anchor" written in code, tests, scripts and other Markdown files.
_DOC_REF = re.compile(r"((?:docs/)?[A-Za-z0-9_-]+\.md)#([A-Za-z0-9_-]+)")


def _doc_files() -> list[str]:
    return [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fence = [], None
    for no, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m and (fence is None or m.group(1) == fence):
            fence = None if fence else m.group(1)
            continue
        if fence is None:
            out.append((no, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its rendered text, lower case, punctuation dropped (not '-' or '_'), spaces to
    dashes (github-slugger's rule; repeats get -1, -2, ... in anchors_of)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link or image renders as its text
    text = _CODE_SPAN.sub(lambda m: m.group(2), text)
    text = re.sub(r"<[^>]+>", "", text).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors_of(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        lines = _prose_lines(f.read())
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in lines:
        anchors.update(_HTML_ID.findall(line))
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2).strip())
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchors.add(base if n == 0 else f"{base}-{n}")
    return anchors


def links_of(path: str) -> list[tuple[int, str]]:
    """(line number, target) of every link outside code: inline, reference definitions and <a href>."""
    with open(path, encoding="utf-8") as f:
        lines = _prose_lines(f.read())
    out = []
    for no, line in lines:
        line = _CODE_SPAN.sub("", line)
        ref = _REF_DEF.match(line)
        targets = [ref.group(1)] if ref else _INLINE_LINK.findall(line)
        out += [(no, t) for t in targets + _HTML_HREF.findall(line)]
    return out


def broken_links(path: str, root: str = REPO) -> list[str]:
    """One message per relative link of a Markdown file whose file or #anchor does not exist (or leaves root)."""
    bad = []
    for no, target in links_of(path):
        if not target or _SCHEME.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        where = f"{os.path.relpath(path, root)}:{no}: {target}"
        if os.path.relpath(dest, root).split(os.sep)[0] == "..":
            bad.append(f"{where}: leaves the repository")
        elif not os.path.exists(dest):
            bad.append(f"{where}: no such file")
        elif anchor and not dest.endswith(".md"):
            bad.append(f"{where}: an anchor into a file that is not Markdown cannot be checked")
        elif anchor and anchor not in anchors_of(dest):
            bad.append(f"{where}: no heading with anchor #{anchor} in {os.path.relpath(dest, root)}")
    return bad


def _h2_headings(path: str) -> list[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        return [(no, line[3:].strip()) for no, line in _prose_lines(f.read()) if line.startswith("## ")]


def test_slug_follows_github():
    assert slug("Checkpoints, resume, conversion and faults") == "checkpoints-resume-conversion-and-faults"
    assert slug("Resharding = full-state conversion") == "resharding--full-state-conversion"
    assert slug("Integrity: nothing lost, nothing silently wrong") == "integrity-nothing-lost-nothing-silently-wrong"
    assert slug("The `--load` flag and [HF](hf.md)") == "the---load-flag-and-hf"
    assert slug("Upstream's `__init__` (DeepSpeed-Ulysses)") == "upstreams-__init__-deepspeed-ulysses"


def test_anchor_repeats_are_numbered(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("# A\n## Notes\n```\n## Not a heading\n```\n## Notes\n<a id=\"here\"></a>\n")
    assert anchors_of(str(doc)) == {"a", "notes", "notes-1", "here"}


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: os.path.relpath(p, REPO))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_a_broken_link_is_caught(tmp_path):
    """The checker itself, on a scratch doc: a missing file, a missing anchor, a way out of the root; links in code
    and absolute URLs are not checked."""
    (tmp_path / "b.md").write_text("# B\n## Here\n")
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "a.md"
    doc.write_text("[ok](../b.md#here) [self](#a) [gone](c.md) [no anchor](../b.md#there) `[code](x.md)`\n# A\n"
                   "[web](https://example.org/x.md#nowhere) [out](../../etc)\n```\n[fenced](y.md)\n```\n")
    assert [m.split(": ", 2)[1:] for m in broken_links(str(doc), str(tmp_path))] == [
        ["c.md", "no such file"], ["../b.md#there", "no heading with anchor #there in b.md"],
        ["../../etc", "leaves the repository"]]


def test_readme_is_short_and_frontier_comes_second():
    readme = os.path.join(REPO, "README.md")
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    assert len(text.splitlines()) <= README_MAX_LINES
    sections = _h2_headings(readme)
    assert len(sections) >= 2 and "CPU" in sections[0][1], sections
    first_section = text.splitlines()[sections[0][0]:sections[1][0] - 1]
    for command in ("bash examples/local/demo_cpu.sh", "bash tests/run.sh"):  # .ci/run runs exactly the latter
        assert any(line.split("#")[0].strip() == command for line in first_section), command
    no, title = sections[1]
    assert "Frontier" in title and no < FRONTIER_BEFORE_LINE, (no, title)


def _files_naming_doc_anchors() -> list[str]:
    roots = ["megatron", "tools", "tests", "examples", "csrc", "bench"]
    files = [os.path.join(REPO, f) for f in ("pretrain_gpt.py", "setup.py")]
    for root in roots:
        for dirpath, _, names in os.walk(os.path.join(REPO, root)):
            files += [os.path.join(dirpath, n) for n in names if n.endswith((".py", ".sh", ".sbatch"))]
    return [f for f in files if os.path.isfile(f) and os.path.abspath(f) != os.path.abspath(__file__)]


def test_doc_anchors_named_in_code_exist():
    """Error messages and docstrings point users at docs/x.md#anchor: each must be a real heading."""
    bad = []
    for path in _files_naming_doc_anchors():
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for name, anchor in _DOC_REF.findall(text):
            dest = os.path.join(REPO, name)
            if not os.path.exists(dest) or anchor not in anchors_of(dest):
                bad.append(f"{os.path.relpath(path, REPO)}: {name}#{anchor}")
    assert bad == []
