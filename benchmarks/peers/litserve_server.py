"""Benchmark peer, not part of capserve: LitServe with dynamic batching (max 32 images, 5 ms), capserve's
preprocessing and the same response JSON as ``/classify``, in LitServe's inference process: the graph on ONNX Runtime
with its default session options (``PEER_BACKEND=onnxruntime``, the default), or the model folder in eager PyTorch
(``PEER_BACKEND=torch``; ``PEER_PRECISION=bf16``: under bf16 autocast). No ``from __future__ import annotations``
here: LitServe reads ``decode_request``'s annotation as a class to hand it the parsed form. Started by
``benchmarks/bench_http.py``::

    python benchmarks/peers/litserve_server.py models/cifar10/model.onnx 8002
    PEER_BACKEND=torch PEER_PRECISION=bf16 python benchmarks/peers/litserve_server.py models/cifar10 8002
"""

import contextlib
import os
import sys

import litserve as ls
import numpy as np
from starlette.requests import Request

from capserve.data.images import load_image
from capserve.data.preprocess import normalize_images
from capserve.runtime import load_runtime


class Classify(ls.LitAPI):
    def __init__(self, model: str, backend: str, precision: str):
        super().__init__(max_batch_size=32, batch_timeout=0.005, api_path="/classify")
        self.model, self.backend, self.precision = model, backend, precision

    def setup(self, device: str) -> None:
        self.meta = load_runtime(self.model, self.backend).metadata
        if self.backend == "torch":
            import torch

            import capserve

            model = capserve.load(self.model)
            bf16 = self.precision == "bf16"

            def logits(x: np.ndarray) -> np.ndarray:
                autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
                with torch.inference_mode(), autocast:
                    return model(torch.from_numpy(x)).float().numpy()

            self.logits = logits
            return
        import onnxruntime as ort

        session = ort.InferenceSession(self.model, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        self.logits = lambda x: session.run(["logits"], {name: x})[0]

    def decode_request(self, request: Request) -> np.ndarray:
        return load_image(request["image"].file.read(), self.meta)  # (C, H, W) uint8

    def batch(self, inputs: list[np.ndarray]) -> np.ndarray:
        return np.stack(inputs)  # (B, C, H, W)

    def predict(self, pixels: np.ndarray) -> np.ndarray:
        logits = self.logits(normalize_images(pixels, self.meta))  # (B, C)
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
    api = Classify(sys.argv[1], os.environ.get("PEER_BACKEND", "onnxruntime"), os.environ.get("PEER_PRECISION", "fp32"))
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, timeout=60)
    server.run(host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", generate_client_file=False)
