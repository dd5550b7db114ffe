"""Benchmark peer, not part of capserve: LitServe with dynamic batching (max 32 images, 5 ms), the same graph with
ONNX Runtime's default session options, capserve's preprocessing and the same response JSON as ``/classify``.
No ``from __future__ import annotations`` here: LitServe reads
``decode_request``'s annotation as a class to hand it the parsed form. Started by ``benchmarks/bench_http.py``::

    python benchmarks/peers/litserve_server.py models/cifar10/model.onnx 8002
"""

import sys

import litserve as ls
import numpy as np
from starlette.requests import Request

from capserve.data.images import load_image
from capserve.data.preprocess import normalize_images
from capserve.runtime import load_runtime


class Classify(ls.LitAPI):
    def __init__(self, model: str):
        super().__init__(max_batch_size=32, batch_timeout=0.005, api_path="/classify")
        self.model = model

    def setup(self, device: str) -> None:
        import onnxruntime as ort

        self.meta = load_runtime(self.model).metadata
        self.session = ort.InferenceSession(self.model, providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0].name

    def decode_request(self, request: Request) -> np.ndarray:
        return load_image(request["image"].file.read(), self.meta)  # (C, H, W) uint8

    def batch(self, inputs: list[np.ndarray]) -> np.ndarray:
        return np.stack(inputs)  # (B, C, H, W)

    def predict(self, pixels: np.ndarray) -> np.ndarray:
        logits = self.session.run(["logits"], {self.input: normalize_images(pixels, self.meta)})[0]  # (B, C)
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    def unbatch(self, probabilities: np.ndarray) -> list[np.ndarray]:
        return list(probabilities)

    def encode_response(self, probabilities: np.ndarray) -> dict:
        order = np.argsort(-probabilities, kind="stable")[:5]
        return {
            "model": self.meta.name,
            "iterations": self.meta.iterations,
            "predictions": [
                {"label": self.meta.labels[i], "index": int(i), "probability": float(probabilities[i])} for i in order
            ],
        }


if __name__ == "__main__":
    server = ls.LitServer(Classify(sys.argv[1]), accelerator="cpu", workers_per_device=1, timeout=60)
    server.run(host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", generate_client_file=False)
