"""Export: checkpoints to ONNX (fixed-T routing unrolled), ONNX to TensorRT engines, and parity checks.

``onnx``, ``onnxscript`` and ``tensorrt`` are imported inside the functions that need them.
"""

from __future__ import annotations

from capserve.errors import ExportError
from capserve.export.onnx import export_checkpoint, export_onnx

__all__ = ["ExportError", "export_checkpoint", "export_onnx"]
