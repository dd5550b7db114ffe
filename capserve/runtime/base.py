"""The one interface every runtime (eager torch, ONNX Runtime, TensorRT) offers to the service, CLI and tests."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from capserve.errors import InputError, RuntimeLoadError  # noqa: F401  (RuntimeLoadError: re-exported)
from capserve.runtime.familiarity import Familiarity
from capserve.runtime.metadata import ModelMetadata

T = TypeVar("T")


def in_worker_thread(work: Callable[[], T], name: str = "capserve-inference") -> T:
    """``work()`` run in a worker thread, its exception re-raised here: inference in a process's main thread
    collapses on an oversubscribed CPU (torch's and ONNX Runtime's thread pools), in a worker thread it does not."""
    result: dict[str, T] = {}
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result["value"] = work()
        except BaseException as e:  # re-raised in the caller's thread
            failure.append(e)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result["value"]


@dataclass(frozen=True)
class Explanation:
    """A prediction with the part-whole parse that routing produced (see ``RoutingTrace.part_whole``)."""

    logits: np.ndarray  # (B, C)
    part_whole: np.ndarray  # (B, C, H, W, I): how strongly each grid capsule routes to each class


class Runtime(ABC):
    """A loaded model: ``predict`` maps normalised float32 images (B, C, H, W) to logits (B, num_classes)."""

    metadata: ModelMetadata
    backend: str
    precision: str = "fp32"  # the arithmetic inference actually uses: fp32, fp16 (graph) or bf16 (torch autocast)
    precision_reason: str = ""  # why, when a server chose it (capserve.runtime.precision.open_torch)
    # the model folder's unfamiliarity calibration (capserve.runtime.familiarity), attached by whoever opens it for
    # answers (capserve.pipeline.models.open_model); None: answers carry no unfamiliarity
    familiarity: Familiarity | None = None

    @property
    @abstractmethod
    def providers(self) -> list[str]:
        """Where inference actually runs, e.g. ["CPUExecutionProvider"] or ["cuda:0"]."""

    @abstractmethod
    def _predict(self, batch: np.ndarray) -> np.ndarray: ...

    def predict(self, batch: np.ndarray) -> np.ndarray:
        """Logits (B, C) as float32 for a checked batch of normalised images (B, C, H, W)."""
        return self._predict(self.check_batch(batch))

    def predict_in_batches(self, images: np.ndarray, batch_size: int = 64) -> np.ndarray:
        """Logits (N, C) for any number of normalised images (N, C, H, W), ``batch_size`` at a time: one call holds
        at most one batch of activations, and an engine's largest batch bounds it."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(images) <= batch_size:  # an empty batch included: ``check_batch`` says what is wrong with it
            return self.predict(images)
        return np.concatenate([self.predict(images[i : i + batch_size]) for i in range(0, len(images), batch_size)])

    def infer(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Logits (B, C) and a capsule network's class capsules (B, C, D) for a checked batch of normalised images;
        None in place of the capsules for a CNN, or a graph exported without them."""
        return self.predict(batch), None

    def infer_in_batches(self, images: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray | None]:
        """``infer`` for any number of images, ``batch_size`` at a time (as ``predict_in_batches``)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(images) <= batch_size:
            return self.infer(images)
        parts = [self.infer(images[i : i + batch_size]) for i in range(0, len(images), batch_size)]
        poses = None if parts[0][1] is None else np.concatenate([p for _, p in parts])  # type: ignore[misc]
        return np.concatenate([logits for logits, _ in parts]), poses

    def explain(self, batch: np.ndarray) -> Explanation:
        """Logits and part-whole parse; backends without routing outputs raise NotImplementedError."""
        raise NotImplementedError(f"the {self.backend} backend cannot explain this artifact")

    def check_batch(self, batch: np.ndarray) -> np.ndarray:
        if not isinstance(batch, np.ndarray):
            raise InputError(f"expected a numpy array, got {type(batch).__name__}")
        if batch.dtype != np.float32:
            raise InputError(f"expected float32 images, got {batch.dtype}; normalise with capserve.data.preprocess")
        if batch.ndim != 4 or batch.shape[1:] != self.metadata.input_shape or batch.shape[0] < 1:
            raise InputError(
                f"expected a batch of shape (B, {', '.join(map(str, self.metadata.input_shape))}) "
                f"with B >= 1, got {batch.shape}"
            )
        return np.ascontiguousarray(batch)
