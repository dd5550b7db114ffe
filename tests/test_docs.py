"""The documentation: the MkDocs site builds in strict mode, and README.md stays a short entrance whose links into
docs/ resolve and whose text, like the docs', names no machine, path or person behind a measurement."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 250
BANNED = ("/work/", "/tmp/", "issue #", "the lead", "a helper", "this session")
LINK = re.compile(r"\]\(([^)\s]+)\)")  # the target of a markdown link [text](target)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (the docs extra)")
def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert (site / "index.html").is_file()
    assert (site / "api" / "index.html").is_file()


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move reference material into docs/"


def test_the_docs_have_their_pages():
    names = {page.name for page in PAGES}
    for name in ("index.md", "routing.md", "training.md", "export.md", "serving.md", "benchmarks.md", "api.md"):
        assert name in names


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_machine_paths_issue_numbers_or_people(path):
    text = path.read_text().lower()
    found = [phrase for phrase in BANNED if phrase in text]
    assert not found, f"{path.relative_to(ROOT)} mentions {found}: say the hardware in general terms instead"


def test_readme_links_into_docs_exist():
    targets = [t for t in LINK.findall(README.read_text()) if t.startswith(("docs/", "./docs/"))]
    assert targets, "README.md should link into docs/"
    missing = [t for t in targets if not (ROOT / t.split("#")[0]).is_file()]
    assert not missing, f"README.md links to missing files: {missing}"
