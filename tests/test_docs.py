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


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built once with ``mkdocs build --strict`` (a warning fails the build)."""
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python", "black"):
        require_module(module)
    out = tmp_path_factory.mktemp("docs") / "site"
    env = dict(os.environ, PYTHONPATH=str(ROOT), NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_mkdocs_build_strict(site):
    cli = (site / "cli" / "index.html").read_text()
    assert "deltastore pull" in cli and "--storage-options" in cli  # the generated CLI reference is in
    api = (site / "api" / "subscriber" / "index.html").read_text()
    assert "bit-exactly" in api  # the docstrings made it in


# a Sphinx role left as text, as it shows in the HTML: :class:`X` or :class:<code>X</code>
_RAW_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const|ref):(?:`|<code>)")


def test_no_page_shows_a_raw_sphinx_role(site):
    shown = {str(page.relative_to(site)): len(_RAW_ROLE.findall(page.read_text()))
             for page in site.rglob("*.html")}
    assert {page: n for page, n in shown.items() if n} == {}


def test_the_api_reference_links_its_names_and_shows_real_defaults(site):
    from deltastore.publish import publisher

    page = (site / "api" / "publisher" / "index.html").read_text()
    # roles became links (the Publisher's docstrings name errors documented on the progress page)
    assert re.search(r'<a class="autorefs autorefs-internal"[^>]*href="\.\./progress/#deltastore\.errors\.\w+"><code>', page)
    # a default that names a module constant shows the constant's value, not its name
    signature = page[page.index('class="doc-signature'):]
    signature = signature[:signature.index("</code>")]
    constants = [name for name in vars(publisher) if name.startswith("DEFAULT_")]
    assert constants and not [name for name in constants if name in signature]
    # the formatter laid the signature out one parameter a line
    assert signature.count("\n") > 10
    # the TRL callback, a class built on first access, is documented from the class its factory defines
    integrations = (site / "api" / "integrations" / "index.html").read_text()
    assert 'id="deltastore.integrations.trl.DeltaStoreCallback"' in integrations
    assert "publishes the model after every optimizer step" in integrations
