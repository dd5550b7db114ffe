"""Benchmark peer, not part of capserve: the plain FastAPI + ONNX Runtime server a user could write in twenty lines.

One image per ONNX Runtime run (no batching), the session with ONNX Runtime's default options, the same graph,
capserve's preprocessing and the same response JSON as capserve's ``/classify``. Started by
``benchmarks/bench_http.py`` (``PEER_MODEL`` = the .onnx file)::

    PEER_MODEL=models/cifar10/model.onnx uvicorn benchmarks.peers.fastapi_server:app --port 8001
"""

from __future__ import annotations

import os
from typing import Annotated

import numpy as np
import onnxruntime as ort
from fastapi import FastAPI, File, UploadFile

from capserve import images
from capserve.runtime import load_runtime

MODEL = os.environ["PEER_MODEL"]
META = load_runtime(MODEL).metadata  # labels, input size, mean/std from the graph's own metadata
SESSION = ort.InferenceSession(MODEL, providers=["CPUExecutionProvider"])
INPUT = SESSION.get_inputs()[0].name
app = FastAPI()


@app.post("/classify")
def classify(image: Annotated[UploadFile, File()], top_k: int = 5) -> dict:
    pixels = images.load_image(image.file.read(), META)[None]  # (1, C, H, W) uint8
    logits = SESSION.run(["logits"], {INPUT: images.normalize_images(pixels, META)})[0][0]  # (C,)
    e = np.exp(logits - logits.max())
    probabilities = e / e.sum()
    order = np.argsort(-probabilities, kind="stable")[:top_k]
    return {"model": META.name, "iterations": META.iterations,
            "predictions": [{"label": META.labels[i], "index": int(i), "probability": float(probabilities[i])}
                            for i in order]}  # fmt: skip
