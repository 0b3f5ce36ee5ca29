"""What a batch script exports before its job step, read without running it: tools/check_job.py judges the
environment the ranks will get, not only the one it is run in (run by hand, the script's own exports and env.sh's are
not there yet).

    env = script_environment("examples/frontier/gpt22b.sbatch", text, os.environ, os.getcwd())
    env["MIOPEN_USER_DB_PATH"]   # '/tmp/u-miopen-cache': exported with a value known now
    "NCCL_NET" in env.maybe      # True: set under a condition (env.sh: OFI or Socket by node count)

The walk reads the script's top-level commands in order: ``export NAME=WORD``, ``NAME=WORD`` (exported when the name
is), ``export NAME``, ``unset NAME``, and ``source FILE`` / ``. FILE`` (followed 3 deep). Function bodies, subshells,
pipelines and background commands change nothing here; what runs under ``if``, ``case``, a loop or after ``&&`` /
``||`` may happen (``maybe``), and so may a value that is not known before the job runs (``$(...)``, ``$1``). Words
expand as bash does for ``$NAME``, ``${NAME}``, ``${NAME:-w}``, ``${NAME-w}``, ``${NAME:=w}``, ``${NAME:+w}``,
``${NAME:?m}``, quotes and ``~``. Stdlib only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

MAX_DEPTH = 3
"""``source`` levels followed (a script, env.sh, one more)."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\+?)=(.*)", re.S)
_OPENERS = {"if": "fi", "case": "esac", "for": "done", "while": "done", "until": "done", "select": "done"}
_CLOSERS = {"fi", "esac", "done"}
_PREFIXES = {"then", "do", "else", "elif", "!", "time"}
_UNKNOWN_SPECIAL = set("0123456789@*#?$!-")


class Unknown(Exception):
    """A word whose value is only known when the job runs."""


@dataclass
class Command:
    words: list[str]
    """Raw words, quotes and expansions as written."""
    prev_sep: str
    """The separator before it: "" (a new line or ``;``), ``&&``, ``||`` (it may not run), ``|``."""
    next_sep: str = ""
    """The separator after it (``|`` or ``&``: it runs in a subshell)."""


def _skip_quoted(text: str, i: int, quote: str) -> int:
    """The index after the closing ``quote`` of the quoted part that opens at ``text[i]``."""
    j = i + 1
    while j < len(text) and text[j] != quote:
        if quote != "'" and text[j] == "\\":
            j += 1
        elif quote == '"' and text.startswith("$(", j):
            j = _skip_balanced(text, j + 1, "(", ")") - 1
        j += 1
    return j + 1


def _skip_balanced(text: str, i: int, open_: str, close: str) -> int:
    """The index after the ``close`` that matches the ``open_`` at ``text[i]`` (quotes inside skipped)."""
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c in "'\"`":
            j = _skip_quoted(text, j, c)
            continue
        if c == "\\":
            j += 2
            continue
        if c == open_:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return j


def commands(text: str) -> Iterator[Command]:
    """The script's simple commands in order, with the separators around them (a small bash lexer: quotes,
    ``$(...)``, ``${...}``, ``((...))``, array assignments and continuations are kept inside their word)."""
    words: list[str] = []
    word, prev_sep, i, n = "", "", 0, len(text)

    def end_word() -> None:
        nonlocal word
        if word:
            words.append(word)
            word = ""

    def end_command(sep: str) -> Command | None:
        nonlocal words, prev_sep
        end_word()
        cmd = Command(words, prev_sep, sep) if words else None
        words, prev_sep = [], sep if sep in ("&&", "||", "|") else ""
        return cmd

    while i < n:
        c = text[i]
        if c == "\\" and text.startswith("\\\n", i):
            i += 2
        elif c == "\\":
            word += text[i:i + 2]
            i += 2
        elif c in "'\"`":
            j = _skip_quoted(text, i, c)
            word += text[i:j]
            i = j
        elif c == "$" and i + 1 < n and text[i + 1] in "({":
            j = _skip_balanced(text, i + 1, text[i + 1], ")" if text[i + 1] == "(" else "}")
            word += text[i:j]
            i = j
        elif c == "(" and word.endswith("=") or text.startswith("((", i) and not word:
            j = _skip_balanced(text, i, "(", ")")  # an array assignment NAME=(...), or arithmetic ((...))
            word += text[i:j]
            i = j
        elif c in "()":
            end_word()
            words.append(c)
            i += 1
        elif c == "#" and not word:
            while i < n and text[i] != "\n":
                i += 1
        elif c in " \t":
            end_word()
            i += 1
        elif c in "\n;&|":
            sep = text[i:i + 2] if text[i:i + 2] in ("&&", "||", ";;") else c
            i += len(sep)
            if sep == "&" and (word.endswith(">") or text.startswith(">", i)):  # 2>&1, &>file: redirections
                word += sep
                continue
            cmd = end_command(sep)
            if cmd is not None:
                yield cmd
        else:
            word += c
            i += 1
    cmd = end_command("\n")
    if cmd is not None:
        yield cmd


class ShellEnv(Mapping[str, str]):
    """The exported variables whose value is known before the job runs (a Mapping), and ``maybe``: exported names
    that may be set, or set to a value known only then."""

    def __init__(self, environ: Mapping[str, str], script: str, cwd: str) -> None:
        self.values: dict[str, str] = dict(environ)
        self.exported: set[str] = set(environ)
        self._unsure: set[str] = set()
        self.script, self.cwd = script, cwd

    @property
    def maybe(self) -> set[str]:
        return self._unsure & self.exported

    def __getitem__(self, name: str) -> str:
        if name in self.exported and name in self.values and name not in self._unsure:
            return self.values[name]
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (k for k in self.values if k in self.exported and k not in self._unsure)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    # ------------------------------------------------------------------ expansion
    def expand(self, word: str) -> str:
        """``word``'s value as bash would give it; raises Unknown when it depends on the running job."""
        out, i, n = [], 0, len(word)
        if word.startswith("~") and (n == 1 or word[1] == "/"):
            out.append(self._var("HOME"))
            i = 1
        while i < n:
            c = word[i]
            if c == "'":
                j = word.find("'", i + 1)
                if j < 0:
                    raise Unknown(word)
                out.append(word[i + 1:j])
                i = j + 1
            elif c == '"':
                j = _skip_quoted(word, i, '"')
                out.append(self._expand_in_quotes(word[i + 1:j - 1]))
                i = j
            elif c == "\\":
                out.append(word[i + 1:i + 2])
                i += 2
            elif c == "`":
                raise Unknown(word)
            elif c == "$":
                value, i = self._dollar(word, i)
                out.append(value)
            else:
                out.append(c)
                i += 1
        return "".join(out)

    def _expand_in_quotes(self, text: str) -> str:
        out, i = [], 0
        while i < len(text):
            c = text[i]
            if c == "\\" and i + 1 < len(text) and text[i + 1] in '$`"\\':
                out.append(text[i + 1])
                i += 2
            elif c == "`":
                raise Unknown(text)
            elif c == "$":
                value, i = self._dollar(text, i)
                out.append(value)
            else:
                out.append(c)
                i += 1
        return "".join(out)

    def _dollar(self, text: str, i: int) -> tuple[str, int]:
        """The expansion that starts with the ``$`` at ``text[i]``: (its value, the index after it)."""
        nxt = text[i + 1:i + 2]
        if nxt == "(":
            raise Unknown(text)  # $(...) and $((...)): known when the job runs
        if nxt == "{":
            j = _skip_balanced(text, i + 1, "{", "}")
            return self._braced(text[i + 2:j - 1]), j
        if nxt == "0":
            return self.script, i + 2
        m = _NAME.match(text, i + 1)
        if m:
            return self._var(m.group()), m.end()
        if nxt and nxt in _UNKNOWN_SPECIAL:
            raise Unknown(text)  # $1, $@, $#, $$, ...
        return "$", i + 1

    def _braced(self, inner: str) -> str:
        m = _NAME.match(inner)
        if not m:
            raise Unknown(inner)  # ${#x}, ${1}, ${@}
        name, rest = m.group(), inner[m.end():]
        if not rest:
            return self._var(name)
        op = next((o for o in (":-", ":=", ":?", ":+", "-", "=", "?", "+") if rest.startswith(o)), None)
        if op is None or name in self._unsure:
            raise Unknown(inner)  # ${x%pat}, ${x/a/b}, ${x:1:2}; or x itself is not known
        value = self.values.get(name)
        is_set = value is not None and (value != "" or ":" not in op)
        arg = rest[len(op):]
        if op.endswith("+"):
            return self.expand(arg) if is_set else ""
        if is_set:
            return value
        if op.endswith("?"):
            raise Unknown(inner)  # the script stops here when it is unset: no value
        got = self.expand(arg)
        if op.endswith("="):
            self.values[name] = got
        return got

    def _var(self, name: str) -> str:
        if name == "PWD" and name not in self.values:
            return self.cwd
        if name in self._unsure:
            raise Unknown(name)
        return self.values.get(name, "")

    # ------------------------------------------------------------------ the walk
    def assign(self, name: str, word: str | None, export: bool, sure: bool, append: bool = False) -> None:
        """``name=word`` (``word`` None: ``export name`` alone); ``sure``: it runs (no condition around it)."""
        was_exported = name in self.exported
        if word is not None:
            try:
                value = (self._var(name) if append else "") + self.expand(word)
            except Unknown:
                self._unsure.add(name)
            else:
                if sure:
                    self.values[name] = value
                    self._unsure.discard(name)
                elif self.values.get(name) != value:
                    self._unsure.add(name)  # set under a condition to another value: it may or may not be
        if export:
            self.exported.add(name)
            if not sure and not was_exported:
                self._unsure.add(name)

    def run(self, words: list[str], sure: bool, depth: int) -> None:
        """One command of the script's own shell: assignments, export, unset, source."""
        assigns = []
        while words and _ASSIGN.fullmatch(words[0]):
            assigns.append(words[0])
            words = words[1:]
        if not words:  # NAME=WORD ...: shell variables (exported if the names are)
            for a in assigns:
                name, plus, value = _ASSIGN.fullmatch(a).groups()
                if not value.startswith("("):  # arrays are never exported
                    self.assign(name, value, False, sure, bool(plus))
            return
        if assigns:
            return  # NAME=WORD cmd: the variable is that command's only
        head, args = words[0], words[1:]
        if head in ("export", "declare", "typeset", "readonly"):
            export = head == "export" or any(a.startswith("-") and "x" in a for a in args)
            for a in args:
                m = _ASSIGN.fullmatch(a)
                if m:
                    self.assign(m.group(1), m.group(3), export, sure, bool(m.group(2)))
                elif _NAME.fullmatch(a):
                    self.assign(a, None, export, sure)
        elif head == "unset":
            for a in (a for a in args if _NAME.fullmatch(a)):
                if sure:
                    self.values.pop(a, None)
                    self._unsure.discard(a)
                else:
                    self._unsure.add(a)
        elif head in ("source", ".") and args and sure:
            self.source(args[0], depth + 1)

    def source(self, word: str, depth: int) -> None:
        """Walk the file ``word`` names; a path that does not exist is looked for in this checkout (a script run
        from another directory names it through $PWD)."""
        if depth > MAX_DEPTH:
            return
        try:
            path = self.expand(word)
        except Unknown:
            return
        path = path if os.path.isabs(path) else os.path.join(self.cwd, path)
        if not os.path.isfile(path):
            path = _in_checkout(path)
        if path is None:
            return
        try:
            with open(path, errors="replace") as f:
                self.walk(f.read(), depth)
        except OSError:
            return

    def walk(self, text: str, depth: int = 0) -> None:
        """Every command of ``text`` in order. What runs inside ``if``, ``case`` and loops, or after ``&&``/``||``,
        may run; function bodies, subshells, pipelines and background commands change nothing here."""
        blocks: list[str] = []
        for cmd in commands(text):
            words = _strip_prefixes(cmd.words)
            if blocks and blocks[-1] == "esac" and ")" in words:  # a case pattern: "pat)" before its commands
                words = _strip_prefixes(words[words.index(")") + 1:])
            if not words:
                continue
            head = words[0]
            if head == "function" or words[1:3] == ["(", ")"]:  # name() { ... } or function name { ... }
                blocks.append("function")
                body = words[2:] if head == "function" else words[3:]
                if body[-1:] == ["}"]:
                    blocks.pop()
                continue
            if head in _OPENERS:
                blocks.append(_OPENERS[head])
                continue
            if head in _CLOSERS or head in ("}", ")"):
                if blocks:
                    blocks.pop()
                continue
            if head in ("{", "("):
                blocks.append(head)
                words = words[1:]
            closes = bool(words) and words[-1] in ("}", ")") and bool(blocks) and blocks[-1] in ("{", "(")
            if closes:
                words = words[:-1]
            subshell = cmd.prev_sep == "|" or cmd.next_sep in ("|", "&")
            if words and not subshell and not any(b in ("function", "(") for b in blocks):
                sure = not any(b in _CLOSERS for b in blocks) and cmd.prev_sep not in ("&&", "||")
                self.run(words, sure, depth)
            if closes:
                blocks.pop()


def _strip_prefixes(words: list[str]) -> list[str]:
    while words and words[0] in _PREFIXES:
        words = words[1:]
    return words


def _in_checkout(path: str) -> str | None:
    """``path``'s file in this checkout (the longest tail of it that exists here), or None."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parts = os.path.normpath(path).split(os.sep)
    for k in range(1, len(parts)):
        candidate = os.path.join(root, *parts[k:])
        if os.path.isfile(candidate):
            return candidate
    return None


def script_environment(script: str, text: str, environ: Mapping[str, str], cwd: str) -> ShellEnv:
    """The environment ``script`` (its ``text``) gives its job step, starting from ``environ`` in ``cwd``."""
    env = ShellEnv(environ, script, cwd)
    env.walk(text)
    return env
