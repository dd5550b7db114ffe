"""Benchmark peer, not part of capserve: the plain FastAPI server a user could write in twenty lines.

One image per run (no batching), capserve's preprocessing and the same response JSON as capserve's ``/classify`` and
``/multilabel``. ``PEER_BACKEND=onnxruntime`` (the default): ONNX Runtime on the graphs, with its default session
options, or with ``PEER_CAREFUL=1`` those a careful user sets: ``intra_op_num_threads`` = the cores,
``inter_op_num_threads`` = 1. ``PEER_BACKEND=torch``: the model folders in eager PyTorch under
``torch.inference_mode()``, with ``PEER_PRECISION=bf16`` under bf16 autocast (fp32 otherwise). Started by
``benchmarks/bench_http.py`` (``PEER_MODEL``, ``PEER_MULTILABEL_MODEL`` = the .onnx files, or the model folders for
torch; the second optional)::

    PEER_MODEL=models/cifar10/model.onnx PEER_MULTILABEL_MODEL=models/multimnist/model.onnx \
        uvicorn benchmarks.peers.fastapi_server:app --port 8001
    PEER_BACKEND=torch PEER_PRECISION=bf16 PEER_MODEL=models/cifar10 uvicorn benchmarks.peers.fastapi_server:app
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Annotated

import numpy as np
from fastapi import FastAPI, File, UploadFile

import capserve
from capserve.data.images import load_image
from capserve.data.preprocess import normalize_images
from capserve.runtime import ModelMetadata, load_runtime

BACKEND = os.environ.get("PEER_BACKEND", "onnxruntime")
PRECISION = os.environ.get("PEER_PRECISION", "fp32")


def open_model(path: str) -> tuple[ModelMetadata, Callable[[np.ndarray], np.ndarray]]:
    """The model's metadata (labels, input size, mean/std) and a function: normalised (1, C, H, W) → logits (1, C)."""
    meta = load_runtime(path, BACKEND).metadata
    if BACKEND == "torch":
        import torch

        model = capserve.load(path)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if PRECISION == "bf16" else contextlib.nullcontext()

        def logits(x: np.ndarray) -> np.ndarray:
            with torch.inference_mode(), autocast:
                return model(torch.from_numpy(x)).float().numpy()

        return meta, logits
    import onnxruntime as ort

    options = ort.SessionOptions()
    if os.environ.get("PEER_CAREFUL") == "1":
        options.intra_op_num_threads = len(os.sched_getaffinity(0))
        options.inter_op_num_threads = 1
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return meta, lambda x: session.run(["logits"], {name: x})[0]


META, LOGITS = open_model(os.environ["PEER_MODEL"])
ML_MODEL = os.environ.get("PEER_MULTILABEL_MODEL")
ML_META, ML_LOGITS = open_model(ML_MODEL) if ML_MODEL else (None, None)
app = FastAPI()


@app.post("/classify")
def classify(image: Annotated[UploadFile, File()], top_k: int = 5) -> dict:
    pixels = load_image(image.file.read(), META)[None]  # (1, C, H, W) uint8
    logits = LOGITS(normalize_images(pixels, META))[0]  # (C,)
    e = np.exp(logits - logits.max())
    probabilities = e / e.sum()
    order = np.argsort(-probabilities, kind="stable")[:top_k]
    return {
        "model": META.name,
        "iterations": META.iterations,
        "predictions": [
            {"label": META.labels[i], "index": int(i), "probability": float(probabilities[i])} for i in order
        ],
    }


@app.post("/multilabel")
def multilabel(image: Annotated[UploadFile, File()], threshold: float | None = None) -> dict:
    pixels = load_image(image.file.read(), ML_META)[None]  # (1, C, H, W) uint8
    probabilities = 1 / (1 + np.exp(-ML_LOGITS(normalize_images(pixels, ML_META))[0]))  # (C,)
    thresholds = np.full(len(ML_META.labels), 0.5 if threshold is None else threshold)
    if threshold is None and ML_META.thresholds is not None:
        thresholds = np.array(ML_META.thresholds)  # the model's own, as capserve uses them
    order = np.argsort(-probabilities, kind="stable")
    return {
        "model": ML_META.name,
        "iterations": ML_META.iterations,
        "threshold": threshold,
        "labels": [
            {"label": ML_META.labels[i], "index": int(i), "probability": float(probabilities[i])}
            for i in order
            if probabilities[i] >= thresholds[i]
        ],
        "probabilities": {name: float(p) for name, p in zip(ML_META.labels, probabilities, strict=True)},
        "thresholds": {name: float(t) for name, t in zip(ML_META.labels, thresholds, strict=True)},
    }
