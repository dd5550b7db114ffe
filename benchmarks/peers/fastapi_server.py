"""Benchmark peer, not part of capserve: the plain FastAPI + ONNX Runtime server a user could write in twenty lines.

One image per ONNX Runtime run (no batching), the same graphs, capserve's preprocessing and the same response JSON
as capserve's ``/classify`` and ``/multilabel``. The sessions take ONNX Runtime's default options, or with
``PEER_CAREFUL=1`` those a careful user sets: ``intra_op_num_threads`` = the cores, ``inter_op_num_threads`` = 1.
Started by ``benchmarks/bench_http.py`` (``PEER_MODEL``, ``PEER_MULTILABEL_MODEL`` = the .onnx files; the second
optional)::

    PEER_MODEL=models/cifar10/model.onnx PEER_MULTILABEL_MODEL=models/multimnist/model.onnx \
        uvicorn benchmarks.peers.fastapi_server:app --port 8001
"""

from __future__ import annotations

import os
from typing import Annotated

import numpy as np
import onnxruntime as ort
from fastapi import FastAPI, File, UploadFile

from capserve.data.images import load_image
from capserve.data.preprocess import normalize_images
from capserve.runtime import load_runtime

OPTIONS = ort.SessionOptions()
if os.environ.get("PEER_CAREFUL") == "1":
    OPTIONS.intra_op_num_threads = len(os.sched_getaffinity(0))
    OPTIONS.inter_op_num_threads = 1
MODEL = os.environ["PEER_MODEL"]
META = load_runtime(MODEL).metadata  # labels, input size, mean/std from the graph's own metadata
SESSION = ort.InferenceSession(MODEL, OPTIONS, providers=["CPUExecutionProvider"])
INPUT = SESSION.get_inputs()[0].name
ML_MODEL = os.environ.get("PEER_MULTILABEL_MODEL")
ML_META = load_runtime(ML_MODEL).metadata if ML_MODEL else None
ML_SESSION = ort.InferenceSession(ML_MODEL, OPTIONS, providers=["CPUExecutionProvider"]) if ML_MODEL else None
app = FastAPI()


@app.post("/classify")
def classify(image: Annotated[UploadFile, File()], top_k: int = 5) -> dict:
    pixels = load_image(image.file.read(), META)[None]  # (1, C, H, W) uint8
    logits = SESSION.run(["logits"], {INPUT: normalize_images(pixels, META)})[0][0]  # (C,)
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
    inputs = {ML_SESSION.get_inputs()[0].name: normalize_images(pixels, ML_META)}
    probabilities = 1 / (1 + np.exp(-ML_SESSION.run(["logits"], inputs)[0][0]))  # (C,)
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
