"""Eager PyTorch runtime: a model directory (safetensors + config.json)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

import capserve
from capserve.checkpoint import WEIGHTS, CheckpointError
from capserve.model import RoutingTrace
from capserve.runtime.base import Explanation, ModelMetadata, Runtime, RuntimeLoadError


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class TorchRuntime(Runtime):
    backend = "torch"

    def __init__(self, path: str | Path, device: str = "cpu", iterations: int | None = None):
        try:
            self.device = torch.device(device)
            self.model = capserve.load(path, self.device)
        except (CheckpointError, RuntimeError) as e:
            raise RuntimeLoadError(str(e)) from e
        self.iterations = self.model._iterations(iterations)
        self.metadata = ModelMetadata.from_config(
            self.model.config, self.iterations, capserve_version=capserve.__version__,
            weights_sha256=file_sha256(Path(path) / WEIGHTS),
        )  # fmt: skip

    @property
    def providers(self) -> list[str]:
        return [str(self.device)]

    @torch.inference_mode()
    def _predict(self, batch: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(batch).to(self.device)
        return self.model(x, iterations=self.iterations).float().cpu().numpy()

    def trace(self, batch: np.ndarray) -> RoutingTrace:
        """Logits, poses and routing coefficients of every layer (eager only)."""
        x = torch.from_numpy(self.check_batch(batch)).to(self.device)
        return self.model.trace(x, iterations=self.iterations)

    def explain(self, batch: np.ndarray) -> Explanation:
        trace = self.trace(batch)
        return Explanation(trace.logits.float().cpu().numpy(), trace.part_whole().float().cpu().numpy())
