"""What a web page costs the service: the static page capserve serves at /ui (``capserve.serving.ui``) against a
Gradio app (BentoML's documented way, ``bentoml.gradio.mount_gradio_app``) doing the same job (an image in, the
labels out). Each variant is measured in a fresh process: the time to import and build it, the resident memory it
adds, the median time to answer a GET of the page over HTTP (uvicorn, on this machine), and with ``--browse`` what a
browser loads for it (requests, bytes, hosts other than the server's). ``--install-size`` sums the files of gradio
and every package it pulls in, and of those that a capserve[serve] environment lacks.

Gradio is not a dependency of capserve: measure it in a throwaway environment.

    python -m venv runs/gr-venv && runs/gr-venv/bin/pip install gradio uvicorn httpx
    runs/gr-venv/bin/python benchmarks/bench_ui.py --app gradio --install-size "$(pip freeze)"
    python benchmarks/bench_ui.py --app static
    runs/gr-venv/bin/python benchmarks/bench_ui.py --app gradio --hold 60 --port 3201 &   # then, with selenium:
    python benchmarks/bench_ui.py --browse http://127.0.0.1:3201/
    python benchmarks/bench_ui.py --app static --hold 60 --port 3202 & python benchmarks/bench_ui.py --browse http://127.0.0.1:3202/
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

from capserve.hardware import cpu_info

ROOT = Path(__file__).resolve().parent.parent


def rss_mib() -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024


def preload(app: str) -> None:
    """What a BentoML server has loaded before it adds a page (so that only the page's own cost is measured):
    numpy, pydantic, starlette, uvicorn, httpx, and for the static page capserve's serving package."""
    import httpx  # noqa: F401
    import numpy  # noqa: F401
    import pydantic  # noqa: F401
    import starlette.applications  # noqa: F401
    import uvicorn  # noqa: F401

    if app == "static":
        sys.path.insert(0, str(ROOT))
        import capserve.serving.guard  # noqa: F401


def build(app: str):
    if app == "static":
        sys.path.insert(0, str(ROOT))
        from capserve.serving.ui import PageApp

        return PageApp()
    import gradio as gr

    def classify(image):  # the page's job: an image in, labels with probabilities out (a stand-in model)
        return {"cat": 0.9, "dog": 0.1}

    from fastapi import FastAPI

    blocks = gr.Interface(classify, gr.Image(type="numpy"), gr.Label(num_top_classes=5))
    return gr.mount_gradio_app(FastAPI(), blocks, path="/")  # what bentoml.gradio.mount_gradio_app does


def serve(app, port: int) -> None:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)


def closure(name: str, seen: set[str]) -> set[str]:
    """``name`` and every distribution it requires (extras aside), by normalised name."""
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen:
        return seen
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return seen
    seen.add(key)
    for requirement in dist.requires or []:
        if "extra ==" in requirement:
            continue
        closure(re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0], seen)
    return seen


def install_size(have: str) -> dict:
    present = {re.sub(r"[-_.]+", "-", line.split("==")[0].split(" @ ")[0]).lower() for line in have.split()}
    sizes = {}
    for key in closure("gradio", set()):
        dist = metadata.distribution(key)
        sizes[key] = sum(dist.locate_file(f).stat().st_size for f in dist.files or [] if dist.locate_file(f).exists())
    new = {k: v for k, v in sizes.items() if k not in present}
    return {
        "packages": len(sizes),
        "MiB": round(sum(sizes.values()) / 2**20, 1),
        "packages_not_in_serve_env": len(new),
        "MiB_not_in_serve_env": round(sum(new.values()) / 2**20, 1),
    }


def browse(url: str) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from support.browser import chromium

    driver = chromium()
    try:
        start = time.perf_counter()
        driver.get(url)
        time.sleep(3)  # a script-built page keeps loading after the document
        entries = driver.execute_script(
            "return performance.getEntries().filter(e => e.entryType === 'navigation' || e.entryType === 'resource')"
            ".map(e => [e.name, e.transferSize || e.encodedBodySize || 0])"
        )
        failed = [e["message"] for e in driver.get_log("browser") if "ERR_NAME_NOT_RESOLVED" in e["message"]]
    finally:
        driver.quit()
    host = re.match(r"https?://[^/]+", url).group(0)
    return {
        "requests": len(entries),
        "KiB": round(sum(size for _, size in entries) / 1024, 1),
        "requests_elsewhere": sorted(
            {re.match(r"https?://[^/]+", n).group(0) for n, _ in entries if not n.startswith((host, "data:", "blob:"))}
        ),
        "blocked_elsewhere": len(failed),
        "s_to_load_plus_3": round(time.perf_counter() - start, 2),
    }


def main() -> None:
    print(f"CPU: {cpu_info().describe()}", flush=True)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--app", choices=("static", "gradio"))
    parser.add_argument("--port", type=int, default=3200)
    parser.add_argument("--hold", type=float, default=0, help="keep serving this many seconds after measuring")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--install-size", metavar="PIP_FREEZE", help="pip freeze of a capserve[serve] environment")
    parser.add_argument("--browse", metavar="URL", help="load URL in headless Chromium and report what it fetched")
    args = parser.parse_args()
    if args.browse:
        print(json.dumps(browse(args.browse)))
        return
    preload(args.app)
    before = rss_mib()
    start = time.perf_counter()
    app = build(args.app)
    built = time.perf_counter() - start
    after = rss_mib()
    import httpx

    serve(app, args.port)
    url = f"http://127.0.0.1:{args.port}/"
    times = []
    with httpx.Client() as client:
        size = len(client.get(url).content)
        for _ in range(args.requests):
            t = time.perf_counter()
            client.get(url).raise_for_status()
            times.append(time.perf_counter() - t)
    result = {
        "app": args.app,
        "import_and_build_s": round(built, 3),
        "rss_added_MiB": round(after - before, 1),
        "page_KiB": round(size / 1024, 1),
        "get_page_ms_median": round(1000 * statistics.median(times), 2),
    }
    if args.install_size:
        result["install"] = install_size(args.install_size)
    print(json.dumps(result), flush=True)
    time.sleep(args.hold)


if __name__ == "__main__":
    main()
