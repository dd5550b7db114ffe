"""The README's Quickstart as a new user types it: it says how to serve on another port and how to skip PyTorch's
index on a machine that cannot reach it, and the Makefile does what it says (``make -n``: printed, never run)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("## Quickstart") : text.index("\n## ", text.index("## Quickstart") + 1)]


def make_dry_run(tmp_path: Path, *args: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    venv = tmp_path / "venv"  # absent: make prints every step of setting it up
    run = subprocess.run(["make", "-n", f"VENV={venv}", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_the_quickstart_says_how_to_serve_on_another_port(tmp_path):
    match = re.search(r"make serve PORT=(\d+)", quickstart())
    assert match, "the Quickstart should show `make serve PORT=N`"
    port = match.group(1)
    assert f"--port {port}" in make_dry_run(tmp_path, "serve", f"PORT={port}")
    assert "--port 3000" in make_dry_run(tmp_path, "serve")


def test_the_quickstart_says_how_to_skip_pytorchs_index(tmp_path):
    text = quickstart()
    assert re.search(r"`(?:make \w+ )?TORCH_INDEX=`", text), "the Quickstart should show an empty TORCH_INDEX="
    assert "60–90 s" in text
    torch_lines = [line for line in make_dry_run(tmp_path, "install", "TORCH_INDEX=").splitlines() if "torch==" in line]
    assert torch_lines and not any("--index-url" in line for line in torch_lines), torch_lines
    default = [line for line in make_dry_run(tmp_path, "install").splitlines() if "torch==" in line]
    assert any("--index-url https://download.pytorch.org/whl/cpu" in line for line in default), default
