"""Runtimes behind one interface.

``load_runtime(path, backend, device)`` gives ``.predict()``, ``.explain()``, ``.metadata`` and ``.providers``.

Backends: ``torch`` (a model directory), ``onnxruntime`` (an .onnx file), ``tensorrt`` (a serialised engine).
Each backend imports its optional packages only when chosen.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from capserve.errors import InputError, RuntimeLoadError
from capserve.runtime.base import Explanation, Runtime
from capserve.runtime.metadata import ModelMetadata

# backend name → "module:class"; imported on first use so that torch-only installs never import onnxruntime
BACKENDS = {
    "torch": "capserve.runtime.torch_backend:TorchRuntime",
    "onnxruntime": "capserve.runtime.onnx_backend:OnnxRuntime",
    "tensorrt": "capserve.runtime.tensorrt_backend:TensorRTRuntime",
}
SUFFIXES = {".onnx": "onnxruntime", ".plan": "tensorrt", ".engine": "tensorrt"}


def infer_backend(path: str | Path) -> str:
    """The backend an artifact needs: model directory → torch, .onnx → onnxruntime, .plan/.engine → tensorrt."""
    path = Path(path)
    if path.is_dir():
        return "torch"
    if path.suffix in SUFFIXES:
        return SUFFIXES[path.suffix]
    raise RuntimeLoadError(f"cannot tell the backend of {path}: expected a model directory, .onnx, .plan or .engine")


def load_runtime(path: str | Path, backend: str | None = None, device: str = "cpu", **options: Any) -> Runtime:
    """Open a model artifact for inference.

    Args:
        path: model directory (torch), .onnx file (onnxruntime) or engine file (tensorrt).
        backend: one of ``BACKENDS``; inferred from ``path`` when None.
        device: "cpu", "cuda" or "cuda:N".
        options: backend-specific, e.g. ``iterations`` for torch.
    """
    if not Path(path).exists():
        raise RuntimeLoadError(f"{path} does not exist")
    backend = backend or infer_backend(path)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    module, cls = BACKENDS[backend].split(":")
    return getattr(importlib.import_module(module), cls)(path, device=device, **options)


__all__ = [
    "BACKENDS",
    "Explanation",
    "InputError",
    "ModelMetadata",
    "Runtime",
    "RuntimeLoadError",
    "infer_backend",
    "load_runtime",
]
