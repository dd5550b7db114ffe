"""The documentation: the MkDocs site builds in strict mode, and README.md stays a short entrance whose links into
docs/ resolve and whose text, like the docs', names no machine, path or person behind a measurement; no file of the
tree names this project's own machine paths or issue numbers."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))  # the benchmark and research pages in their folders included
README_MAX_LINES = 250
# The patterns are written so that this file does not match them itself (``\/`` is a plain "/", ``\d`` no digit).
# Anywhere in the tree: the checkout's and the data's folders, and issue numbers, which mean nothing to a reader.
MACHINE_WORDS = re.compile(r"/work\/|\.\./shared/data|issue #\d+", re.IGNORECASE)
# In README and docs also: temporary folders and the people or sessions behind a measurement.
DOCS_WORDS = re.compile(r"/tmp\/|issue #|the lead|a helper|this session", re.IGNORECASE)
BINARY_SUFFIXES = frozenset({".onnx", ".safetensors", ".png", ".jpg", ".jpeg", ".npz", ".npy", ".pt", ".gz", ".data"})
LINK = re.compile(r"\]\(([^)\s]+)\)")  # the target of a markdown link [text](target)
# A figure: a number that does not start inside a word, an anchor or a dotted name, with its thousands commas,
# decimals and a trailing % or ×; kept where it has a point, a comma, a % or a × or at least three digits.
FIGURE = re.compile(r"(?<![A-Za-z0-9_.#])\d+(?:[.,]\d+)*(?:%|×)?")
FIGURES = ROOT / "tests" / "fixtures" / "doc_figures.txt"


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


def figures(text: str) -> set[str]:
    """Every figure of a text, as ``FIGURE`` finds it."""
    return {
        token
        for token in FIGURE.findall(text)
        if any(mark in token for mark in ".,%×") or sum(c.isdigit() for c in token) >= 3
    }


def docs_figures() -> set[str]:
    """Every figure of every page under docs/, the research pages and benchmark pages included."""
    return set().union(*(figures(page.read_text()) for page in PAGES))


def test_every_figure_the_docs_had_is_still_in_the_docs():
    # tests/fixtures/doc_figures.txt lists the docs' figures, one a line: a page that moves or splits keeps them all,
    # so a figure missing here is a measurement lost on the way. A figure removed on purpose leaves the list with it.
    had = [line for line in FIGURES.read_text().splitlines() if line]
    assert had, f"{FIGURES.relative_to(ROOT)} is empty"
    missing = sorted(set(had) - docs_figures())
    assert not missing, f"{len(missing)} figures are in no page under docs/ any more: {missing}"


def test_the_figure_check_finds_figures_and_skips_names():
    text = "ONNX Runtime fp32 on an H100 serves 1,234 images/s (1.54× torch, 12% more; 0.823 accuracy), seed 7."
    assert figures(text) == {"1,234", "1.54×", "12%", "0.823"}


def test_the_docs_have_their_pages():
    names = {page.relative_to(ROOT / "docs").as_posix() for page in PAGES}
    for name in (
        "index.md",
        "routing.md",
        "training.md",
        "export.md",
        "serving.md",
        "benchmarks.md",
        "api.md",
        "own-data.md",
        "research/index.md",
    ):
        assert name in names


def words_found(path: Path, pattern: re.Pattern[str] = MACHINE_WORDS) -> list[str]:
    """``"LINE: MATCH"`` for each match of ``pattern`` in a text file; nothing for a binary one (by suffix, a NUL
    byte or bytes that are not UTF-8)."""
    if path.suffix.lower() in BINARY_SUFFIXES:
        return []
    data = path.read_bytes()
    if b"\0" in data:
        return []
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return []
    return [
        f"{number}: {match.group(0)}"
        for number, line in enumerate(text.splitlines(), 1)
        for match in pattern.finditer(line)
    ]


def tree_files() -> list[Path]:
    """Every file git tracks or would track (untracked but not ignored), as it is on disk now."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout (an unpacked sdist or wheel)")
    names = [name for name in listed.stdout.decode().split("\0") if name]
    return [ROOT / name for name in names if (ROOT / name).is_file()]  # tracked files deleted on disk drop out


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_machine_paths_issue_numbers_or_people(path):
    found = words_found(path, MACHINE_WORDS) + words_found(path, DOCS_WORDS)
    assert not found, f"{path.relative_to(ROOT)} mentions {found}: say the hardware in general terms instead"


def test_no_file_in_the_tree_names_a_machine_path_or_an_issue_number():
    files = tree_files()
    assert README in files and ROOT / "capserve" / "__init__.py" in files
    found = {path.relative_to(ROOT).as_posix(): hits for path in files if (hits := words_found(path))}
    assert not found, (
        f"machine paths or issue numbers in {found}: take data folders as arguments (default data/), "
        "and say what a rule is for instead of which issue asked for it"
    )


def test_the_tree_check_finds_each_word_and_skips_binaries(tmp_path):
    # Concatenated so that this file stays clean for the check above.
    lines = ["--data /" + "work/shared/data", "python x.py --data ../" + "shared/data", "as issue " + "#12 asked"]
    text = tmp_path / "notes.md"
    text.write_text("a clean line\n" + "\n".join(lines) + "\n")
    assert [hit.split(": ", 1)[0] for hit in words_found(text)] == ["2", "3", "4"]
    clean = tmp_path / "clean.py"
    clean.write_text("issue #N, /work and shared data, without the shapes that are looked for\n")
    assert words_found(clean) == []
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\0" + lines[0].encode())
    assert words_found(binary) == []
    assert words_found(tmp_path / "notes.md", DOCS_WORDS) == ["4: issue #"]


def test_readme_links_into_docs_exist():
    targets = [t for t in LINK.findall(README.read_text()) if t.startswith(("docs/", "./docs/"))]
    assert targets, "README.md should link into docs/"
    missing = [t for t in targets if not (ROOT / t.split("#")[0]).is_file()]
    assert not missing, f"README.md links to missing files: {missing}"
