"""``capserve predict MODEL SOURCE... [--out FILE]``: the service's answers for files, folders, globs, CSV manifests
or paths on stdin, without a server.

Streams: paths are read one at a time, decoded by a thread pool a few batches ahead of the runtime, answered in
batches of ``--batch-size`` and written in the input's order, flushed after every batch, so memory stays flat
whatever the number of images and a killed run keeps every row it wrote. ``--resume`` skips the paths the output
file already holds (a last row cut short by the kill is dropped first). A file that cannot be read becomes a row
with the server's error; the exit status is 1 only when nothing could be answered, or when more than
``--max-failures`` of the images failed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import json
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

from capserve.data.progress import progress_bar
from capserve.errors import UsageError
from capserve.predict.inputs import expand
from capserve.predict.predictor import Predictor
from capserve.runtime import BACKENDS

log = logging.getLogger(__name__)

# the last two: how unlike the model's training images the image is, and whether above its threshold (empty where
# the model has no calibration)
CSV_COLUMNS = ("path", "label", "probability", "answer", "error", "unfamiliarity", "unfamiliar")
PREFETCH_BATCHES = 2  # batches decoded ahead of the one the runtime answers


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        help="a model folder, an exported .onnx (or INT8) file, a TensorRT engine, or "
        "NAME[:VERSION] in BentoML's model store (as capserve serve takes it)",
    )
    p.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="image files, folders (recursive), globs, CSV "
        "manifests (their image column) or - (one path per line on stdin)",
    )
    p.add_argument("--out", help="write the rows here: .csv or .jsonl (default: JSON Lines on stdout)")
    p.add_argument(
        "--top-k",
        type=int,
        help="single-label models: labels per image (default: up to 5, never more than the model has)",
    )
    p.add_argument(
        "--threshold",
        type=float,
        help="multi-label models: one threshold for every label (default: the model's calibrated ones)",
    )
    p.add_argument("--backend", choices=list(BACKENDS), default="onnxruntime")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"), help="as CAPSERVE_PRECISION")
    p.add_argument("--iterations", type=int, help="torch backend: routing iterations (default: the model's)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="decoding threads")
    p.add_argument("--resume", action="store_true", help="skip the paths --out already holds and append to it")
    p.add_argument(
        "--max-failures",
        type=float,
        default=1.0,
        metavar="FRACTION",
        help="exit 1 when more than this fraction of the images fail (default 1: only when all do)",
    )


# ------------------------------------------------------------------------------------------------ output


def output_format(path: str | None) -> str:
    if path is None:
        return "jsonl"
    suffix = Path(path).suffix.lower()
    if suffix not in (".csv", ".jsonl", ".json"):
        raise UsageError(f"--out {path}: write .csv or .jsonl (JSON Lines)")
    return "csv" if suffix == ".csv" else "jsonl"


def done_paths(path: Path, fmt: str) -> set[str]:
    """The paths an earlier run wrote to ``path``, after dropping a last row the kill cut short."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):  # an unfinished last row: it is answered again
        with open(path, "r+b") as f:
            f.truncate(end)
    text = data[:end].decode()
    if fmt == "csv":
        return {row["path"] for row in csv.DictReader(text.splitlines()) if row.get("path")}
    return {json.loads(line)["path"] for line in text.splitlines() if line.strip()}


class Writer:
    """Rows in CSV (``CSV_COLUMNS``) or JSON Lines (the path, then the server's JSON body or the error)."""

    def __init__(self, stream: TextIO, fmt: str, header: bool):
        self.stream, self.fmt = stream, fmt
        self.csv = csv.writer(stream) if fmt == "csv" else None
        if self.csv is not None and header:
            self.csv.writerow(CSV_COLUMNS)

    def write(self, path: str, record: dict[str, Any]) -> None:
        if self.csv is None:
            self.stream.write(json.dumps({"path": path, **record}) + "\n")
            return
        if "error" in record:
            self.csv.writerow((path, "", "", "", record["error"], "", ""))
            return
        top = (record.get("predictions") or record.get("labels") or [None])[0]
        label, probability = (top["label"], f"{top['probability']:.6g}") if top else ("", "")
        score, flag = record.get("unfamiliarity"), record.get("unfamiliar")
        familiar = ("", "") if score is None else (f"{score:.6g}", "true" if flag else "false")
        self.csv.writerow((path, label, probability, json.dumps(record), "", *familiar))


# ------------------------------------------------------------------------------------------------ the run


def batches(paths: Iterator[str], size: int) -> Iterator[list[str]]:
    while chunk := list(itertools.islice(paths, size)):
        yield chunk


def answer_stream(
    predictor: Predictor, paths: Iterator[str], batch_size: int, workers: int
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, record) in the input's order; decoding (``Predictor.pixels``) runs ``PREFETCH_BATCHES`` batches ahead
    in ``workers`` threads while the runtime answers the oldest batch (``Predictor.answer``)."""
    pending: deque[tuple[list[str], list[Future]]] = deque()
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="decode") as pool:
        chunks = batches(paths, batch_size)

        def submit() -> bool:
            chunk = next(chunks, None)
            if chunk is None:
                return False
            pending.append((chunk, [pool.submit(predictor.pixels, p) for p in chunk]))
            return True

        while len(pending) < PREFETCH_BATCHES + 1 and submit():
            pass
        while pending:
            chunk, futures = pending.popleft()
            submit()
            records = predictor.answer([f.result() for f in futures])
            yield from zip(chunk, records, strict=True)


def run(args: argparse.Namespace) -> int:
    fmt = output_format(args.out)
    if args.batch_size < 1 or args.workers < 1:
        raise UsageError("--batch-size and --workers must be >= 1")
    if not 0 <= args.max_failures <= 1:
        raise UsageError(f"--max-failures is a fraction in [0, 1], got {args.max_failures}")
    if args.resume and not args.out:
        raise UsageError("--resume appends to --out FILE: give --out too")
    predictor = Predictor(
        args.model,
        backend=args.backend,
        device=args.device,
        precision=args.precision,
        iterations=args.iterations,
        top_k=args.top_k,
        threshold=args.threshold,
    )
    out = Path(args.out) if args.out else None
    skip: set[str] = set()
    if out is not None and args.resume and out.is_file():
        skip = done_paths(out, fmt)
        log.info("--resume: %d images already in %s are skipped", len(skip), out)
    elif out is not None and out.exists() and not args.resume:
        raise UsageError(f"--out {out} exists: give --resume to continue it, or another file")
    paths = (p for p in expand(args.sources) if p not in skip)
    # a file this run creates is removed again if it answers nothing, so that it does not block the next run
    new_out = out if out is not None and not out.exists() else None
    images = failures = 0
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stream = stack.enter_context(open(out, "a", newline="")) if out is not None else sys.stdout
        writer = Writer(stream, fmt, header=out is None or out.stat().st_size == 0)
        bar = stack.enter_context(progress_bar(None, "predict"))
        stack.callback(stream.flush)
        for i, (path, record) in enumerate(answer_stream(predictor, paths, args.batch_size, args.workers)):
            writer.write(path, record)
            images, failures = images + 1, failures + ("error" in record)
            bar.update()
            if (i + 1) % args.batch_size == 0:
                stream.flush()
    seconds = time.perf_counter() - start
    if new_out is not None and not images:
        new_out.unlink()
    print(
        f"capserve predict: {images} images, {failures} failed, {images / max(seconds, 1e-9):.1f} images/s"
        + (f" ({len(skip)} skipped: already in {out})" if skip else ""),
        file=sys.stderr,
    )
    if images and images == failures:
        print("capserve predict: no image could be answered", file=sys.stderr)
        return 1
    if images and failures / images > args.max_failures:
        print(
            f"capserve predict: {failures / images:.1%} of the images failed (--max-failures {args.max_failures:g})",
            file=sys.stderr,
        )
        return 1
    if not images and not skip:
        print("capserve predict: the sources hold no image", file=sys.stderr)
        return 1
    return 0
