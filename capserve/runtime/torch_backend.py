"""Eager PyTorch runtime: a model directory (safetensors + config.json)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

import capserve
from capserve.errors import CheckpointError, RuntimeLoadError
from capserve.hashing import file_sha256
from capserve.model.capsnet import RoutingTrace
from capserve.model.checkpoint import WEIGHTS
from capserve.runtime.base import Explanation, Runtime
from capserve.runtime.metadata import ModelMetadata

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class TorchRuntime(Runtime):
    """Eager PyTorch on a model directory.

    Args:
        path: model directory (``model.safetensors`` + ``config.json``).
        device: "cpu", "cuda" or "cuda:N".
        iterations: routing iterations T (default: the config's; a CNN without routing takes none).
        precision: "fp32", or "bf16"/"fp16" autocast (bf16 pays only on a CPU with native bf16 arithmetic;
            docs/export.md).
        threads: on a CPU, the intra-op threads each call runs on, in whichever thread calls it (``with_threads``);
            None: the process's setting (``torch.set_num_threads``).
    """

    backend = "torch"

    def __init__(
        self,
        path: str | Path,
        device: str = "cpu",
        iterations: int | None = None,
        precision: str = "fp32",
        threads: int | None = None,
    ):
        if precision not in AUTOCAST:
            raise ValueError(f"precision must be one of {', '.join(AUTOCAST)}, got {precision!r}")
        self.precision = precision
        self.autocast = AUTOCAST[precision]
        self.threads = threads
        try:
            self.device = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"bad device {device!r}: use 'cpu', 'cuda' or 'cuda:N'") from e
        if self.device.type == "cuda" and not torch.cuda.is_available():
            # a CPU wheel raises AssertionError("Torch not compiled with CUDA enabled") on the first CUDA call
            why = "is a CPU build" if torch.version.cuda is None else "sees no CUDA GPU"
            raise RuntimeLoadError(
                f"device {device!r} asked for, but this torch ({torch.__version__}) {why}: install "
                "a CUDA build of torch, or use the onnxruntime backend (onnxruntime-gpu) or the "
                "cpu device"
            )
        try:
            self.model = capserve.load(path, self.device)
        except (CheckpointError, RuntimeError) as e:
            raise RuntimeLoadError(str(e)) from e
        self.iterations = self.model.resolve_iterations(iterations)
        self.metadata = ModelMetadata.from_config(
            self.model.config,
            self.iterations,
            capserve_version=capserve.__version__,
            weights_sha256=file_sha256(Path(path) / WEIGHTS),
        )

    @property
    def providers(self) -> list[str]:
        return [str(self.device)]

    def at_precision(self, precision: str) -> TorchRuntime:
        """The same loaded model (weights shared, not copied) run at another precision, e.g. an fp32 reference."""
        if precision not in AUTOCAST:
            raise ValueError(f"precision must be one of {', '.join(AUTOCAST)}, got {precision!r}")
        other = copy.copy(self)
        other.precision, other.autocast = precision, AUTOCAST[precision]
        return other

    def with_threads(self, threads: int) -> TorchRuntime:
        """The same loaded model (weights shared) whose calls run on ``threads`` intra-op threads, whichever thread
        makes them: e.g. two batches at once, one thread each, beside lone requests on every core.

        Torch keeps the intra-op thread count per calling thread (OpenMP's is a thread's own setting), so each call
        sets its caller's count while it runs: a server's worker threads take batches and lone requests alike."""
        other = copy.copy(self)
        other.threads = threads
        return other

    @contextmanager
    def _running(self) -> Iterator[None]:
        """What one call runs under: ``threads`` intra-op threads in the calling thread (its own count back
        afterwards: the caller's setting is not this runtime's to keep), and autocast."""
        before = torch.get_num_threads()
        switch = bool(self.threads) and self.device.type == "cpu" and before != self.threads
        if switch:
            torch.set_num_threads(self.threads)
        try:
            with nullcontext() if self.autocast is None else torch.autocast(self.device.type, dtype=self.autocast):
                yield
        finally:
            if switch:
                torch.set_num_threads(before)

    @torch.inference_mode()
    def _predict(self, batch: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(batch).to(self.device)
        with self._running():
            return self.model(x, iterations=self.iterations).float().cpu().numpy()

    @torch.inference_mode()
    def infer(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        if not self.model.config.has_routing:
            return self.predict(batch), None
        x = torch.from_numpy(self.check_batch(batch)).to(self.device)
        with self._running():
            poses, _ = self.model.route(x, self.iterations, keep_coefficients=False)
            logits = self.model.logits_from(poses[-1])  # (B, C)
        return logits.float().cpu().numpy(), poses[-1].float().cpu().numpy()  # (B, C), (B, C, D)

    def trace(self, batch: np.ndarray) -> RoutingTrace:
        """Logits, poses and routing coefficients of every layer (eager only; capsule networks only)."""
        if not self.model.config.has_routing:
            raise NotImplementedError(f"{self.metadata.name} is a CNN without routing: there is no routing to trace")
        x = torch.from_numpy(self.check_batch(batch)).to(self.device)
        with self._running():
            return self.model.trace(x, iterations=self.iterations)

    def explain(self, batch: np.ndarray) -> Explanation:
        trace = self.trace(batch)
        return Explanation(trace.logits.float().cpu().numpy(), trace.part_whole().float().cpu().numpy())
