"""The package as users install it: build the wheel, install it with its [export,serve] extras into a fresh
virtual environment, and use it from a folder outside the checkout: export, verify, and `capserve serve` answering
HTTP requests through the real `bentoml serve` of the installed package's service.

An editable install hides packaging mistakes (a subpackage missing from the wheel still imports from the
checkout), so every other test would pass with a broken wheel. ~1-2 min: most of it is pip installing torch
(the local CPU build first, so that nothing pulls a CUDA one) and the extras' dependencies.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import venv
from pathlib import Path

import httpx
import pytest
from support.server import wait_ready

from capserve.serving.settings import Settings
from capserve.serving.workers import worker_count

ROOT = Path(__file__).resolve().parents[1]
CIFAR10 = ROOT / "models" / "cifar10"


def source_modules() -> set[str]:
    """Every module the checkout has, named as installed."""
    names = set()
    for path in (ROOT / "capserve").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def run(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(args)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    dist = tmp_path / "dist"
    run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(dist)],
        tmp_path,
        env,
    )
    (wheel,) = dist.glob("capserve-*.whl")

    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q"]
    # the CPU build as `make install` takes it (from PyPI the same pin is a multi-GB CUDA build); TORCH_INDEX
    # overrides it as it does for make, and empty leaves pip's configuration alone. Few retries: a machine without
    # that index's host (a local wheel in pip's find-links instead) would spend minutes retrying it
    index = os.environ.get("TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
    run(
        [*pip, "torch==2.13.0", *(["--index-url", index] if index else []), "--retries", "1", "--timeout", "15"],
        tmp_path,
        env,
    )
    run([*pip, f"{wheel}[export,serve]"], tmp_path, env)

    work = tmp_path / "elsewhere"  # outside the checkout: nothing can import from the source tree
    work.mkdir()
    expected = sorted(source_modules())
    imported = run(
        [
            str(python),
            "-c",
            "import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    module = importlib.import_module(name)\n"
            "    print(module.__file__)",
            *expected,
        ],
        work,
        env,
    ).split()
    assert len(imported) == len(expected)
    assert all(str(tmp_path / "venv") in path for path in imported), imported  # the wheel's, not the checkout's

    model = work / "cifar10"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(CIFAR10 / name, model / name)
    capserve = str(tmp_path / "venv" / "bin" / "capserve")
    assert (
        run([capserve, "export", "onnx", "cifar10", "-o", "cifar10/model.onnx"], work, env)
        .strip()
        .endswith("model.onnx")
    )
    out = run([capserve, "verify", "cifar10/model.onnx", "--against", "cifar10", "--batch-sizes", "1,5"], work, env)
    assert "cifar10-resnet, T=2, fp32, onnxruntime on CPUExecutionProvider" in out and out.strip().endswith("passed")
    # offline prediction from the wheel: capserve.predict ships, and answers a folder as the service would
    (work / "images").mkdir()
    shutil.copy(ROOT / "tests" / "fixtures" / "cifar10-test-200.png", work / "images" / "mosaic.png")
    (work / "images" / "broken.png").write_bytes(b"not an image")
    rows = [json.loads(line) for line in run([capserve, "predict", "cifar10", "images"], work, env).splitlines()]
    assert [r["path"] for r in rows] == ["images/broken.png", "images/mosaic.png"]
    assert rows[0]["error"].startswith("the image: ") and len(rows[1]["predictions"]) == 5

    # serving from the wheel: the service is a module of the installed package (service.py is not in the wheel)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = work / "serve.log"
    serve_env = {**env, "BENTOML_HOME": str(tmp_path / "bentoml"), "BENTOML_DO_NOT_TRACK": "True"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [capserve, "serve", "cifar10", "--host", "127.0.0.1", "--port", str(port)],
            cwd=work,
            env=serve_env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, log, timeout=180)
        image = (ROOT / "tests" / "fixtures" / "cifar10-test-200.png").read_bytes()
        r = httpx.post(f"{url}/classify", files={"image": ("x.png", image, "image/png")}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "cifar10-resnet" and len(r.json()["predictions"]) == 5
        described = httpx.get(f"{url}/model", timeout=30).json()
        assert described["single_label"]["name"] == "cifar10-resnet" and described["multi_label"] is None
        assert "<title>capserve</title>" in httpx.get(f"{url}/ui/", timeout=30).text  # the page is package data
        default = worker_count(Settings())  # CAPSERVE_WORKERS unset, no tuned file: auto, one worker on a CPU
        assert described["workers"] == default == 1, described
        assert described["choices"]["workers"] == {"value": 1, "set_by": "default"}, described
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    r = subprocess.run([capserve, "serve", "nosuch"], cwd=work, env=serve_env, capture_output=True, text=True)
    assert r.returncode == 2 and "MODEL 'nosuch' is not a file" in r.stderr and "Traceback" not in r.stderr


def test_make_install_takes_torch_from_the_cpu_index_and_can_be_told_otherwise(tmp_path):
    """`torch==2.13.0` alone is a CUDA build from PyPI: `make install` names PyTorch's CPU index (the bentofiles'),
    a GPU machine overrides it, and an empty TORCH_INDEX leaves pip's own configuration (local wheels) alone."""
    import yaml

    def torch_line(*overrides: str) -> str:
        r = subprocess.run(
            ["make", "-n", "install", f"VENV={tmp_path / 'v'}", *overrides],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        (line,) = [line for line in r.stdout.splitlines() if '"torch==' in line]
        return line

    cpu = "https://download.pytorch.org/whl/cpu"
    for bentofile in ("bentofile.yaml", "bentofile-cpu.yaml"):
        assert yaml.safe_load((ROOT / bentofile).read_text())["python"]["extra_index_url"] == [cpu]
    assert torch_line().endswith(f'"torch==2.13.0" --index-url {cpu}')
    gpu = "https://download.pytorch.org/whl/cu128"
    assert torch_line(f"TORCH_INDEX={gpu}").endswith(f"--index-url {gpu}")
    assert "--index-url" not in torch_line("TORCH_INDEX=")
