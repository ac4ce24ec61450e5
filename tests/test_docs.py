"""The docs: every snippet marked runnable runs; the site builds with ``mkdocs build --strict``.

A fenced ```python block directly preceded by the line ``<!-- deltastore:run -->`` is run (in a
fresh namespace, in a temporary working directory); one preceded by
``<!-- deltastore:skip REASON -->`` is reported as skipped with REASON (it needs a GPU, a cloud,
a cluster: skipped by design, not a missing dependency). The markers are HTML comments, invisible
on GitHub and in the mkdocs site.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from conftest import ROOT, require_module

DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_MARKER = re.compile(r"^<!-- deltastore:(run|skip)(?: (.*?))? -->\s*$")
_FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass
class Snippet:
    path: str
    line: int
    mode: str  # "run" or "skip"
    reason: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def snippets() -> list[Snippet]:
    """Every marked block of README.md and docs/*.md; a marker not followed by a python fence is an error."""
    found = []
    for path in DOC_FILES:
        lines = path.read_text().splitlines()
        for i, text in enumerate(lines):
            m = _MARKER.match(text)
            if m is None:
                continue
            rel = str(path.relative_to(ROOT))
            fence = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if fence is None or fence.group(1) != "python":
                raise AssertionError(f"{rel}:{i + 1}: a deltastore:{m.group(1)} marker must precede a ```python block")
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            if m.group(1) == "skip" and not m.group(2):
                raise AssertionError(f"{rel}:{i + 1}: a skip marker needs a reason")
            found.append(Snippet(rel, i + 2, m.group(1), m.group(2) or "", "\n".join(lines[i + 2:end]) + "\n"))
    return found


SNIPPETS = snippets()


def test_the_docs_mark_runnable_snippets():
    marked = {s.path for s in SNIPPETS if s.mode == "run"}
    assert {"README.md", "docs/quickstart.md", "docs/codecs.md"} <= marked


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.id)
def test_snippet(snippet, tmp_path, monkeypatch):
    if snippet.mode == "skip":
        pytest.skip(f"{snippet.id}: {snippet.reason} (skipped by design)")
    monkeypatch.chdir(tmp_path)
    code = compile(snippet.code, snippet.id, "exec")  # tracebacks name the doc file and line
    exec(code, {"__name__": "__snippet__"})


def test_mkdocs_build_strict(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        require_module(module)
    env = dict(os.environ, PYTHONPATH=str(ROOT), NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cli = (tmp_path / "site" / "cli" / "index.html").read_text()
    assert "deltastore pull" in cli and "--storage-options" in cli  # the generated CLI reference is in
    api = (tmp_path / "site" / "api" / "subscriber" / "index.html").read_text()
    assert "bit-exactly" in api  # the docstrings made it in
