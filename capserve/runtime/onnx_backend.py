"""ONNX Runtime backend: an .onnx file written by ``capserve export onnx``, on CPU, CUDA or TensorRT providers."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from capserve.runtime.base import Explanation, ModelMetadata, Runtime, RuntimeLoadError

log = logging.getLogger(__name__)

# written by capserve.export.onnx (kept here so that serving never imports the exporter)
METADATA_KEY = "capserve.metadata"
PRECISION_KEY = "capserve.precision"
LOGITS, PART_WHOLE = "logits", "part_whole"
OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")
CPU = "CPUExecutionProvider"

Provider = str | tuple[str, dict[str, Any]]


# cuDNN's convolution algorithm search: ONNX Runtime's default, EXHAUSTIVE, benchmarks every algorithm for each
# new input shape, and adaptive batching sends every batch size from 1 to CAPSERVE_MAX_BATCH_SIZE, so requests
# would pay a tuning run whenever a new size comes along (or start-up would have to warm up every size).
# HEURISTIC picks from cuDNN's heuristics without benchmarking: no per-shape cost, no warm-up per size needed.
CONV_ALGO_SEARCH = "HEURISTIC"


def providers_for(device: str) -> list[Provider]:
    """Execution providers for a device: "cpu" → CPU; "cuda" / "cuda:N" → CUDA (device N), then CPU."""
    if device == "cpu":
        return [CPU]
    if device == "cuda" or device.startswith("cuda:"):
        index = device.partition(":")[2] or "0"
        if not index.isdigit():
            raise ValueError(f"bad device {device!r}: use 'cpu', 'cuda' or 'cuda:N'")
        return [("CUDAExecutionProvider", {"device_id": int(index), "cudnn_conv_algo_search": CONV_ALGO_SEARCH}), CPU]
    raise ValueError(f"unknown device {device!r} for onnxruntime: use 'cpu', 'cuda' or 'cuda:N'")


def installed_onnxruntimes() -> list[str]:
    """The ONNX Runtime distributions installed: more than one means a broken install (they share one module)."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ("onnxruntime", "onnxruntime-gpu"):
        try:
            version(name)
            found.append(name)
        except PackageNotFoundError:
            pass
    return found


def _name(provider: Provider) -> str:
    return provider if isinstance(provider, str) else provider[0]


class OnnxRuntime(Runtime):
    """An exported capsule model in ONNX Runtime.

    Args:
        path: .onnx file from ``capserve export onnx``.
        device: "cpu", "cuda" or "cuda:N"; chooses the providers unless ``providers`` is given.
        providers: explicit execution providers, names or (name, options), in priority order, e.g.
            ``["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]``. The first one
            must be the one the session actually uses (onnxruntime-gpu falls back to CPU silently otherwise).
        graph_optimization: "disable", "basic", "extended" or "all".
        threads: intra-op threads (0: ONNX Runtime's default, one per core).
        memory_arena: keep freed CPU memory for reuse (faster); False returns it, for many sessions in one
            process (an arena holds its peak: GBs at batch 64 for T >= 3).
    """

    backend = "onnxruntime"

    def __init__(self, path: str | Path, device: str = "cpu", providers: list[Provider] | None = None,
                 graph_optimization: str = "all", threads: int = 0, memory_arena: bool = True):  # fmt: skip
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise RuntimeLoadError("onnxruntime is not installed: pip install 'capserve[export]' "
                                   "(or 'capserve[gpu]' for onnxruntime-gpu on NVIDIA machines)") from e  # fmt: skip
        if len(installed_onnxruntimes()) > 1:
            raise RuntimeLoadError("both onnxruntime and onnxruntime-gpu are installed: they install one module, "
                                   "and mixed they leave no working CUDA provider. GPU machines: `pip uninstall -y "
                                   "onnxruntime onnxruntime-gpu && pip install 'capserve[gpu]'`; CPU machines: "
                                   "`pip uninstall -y onnxruntime-gpu onnxruntime && pip install "
                                   "'capserve[serve]'`")  # fmt: skip
        if graph_optimization not in OPTIMIZATION_LEVELS:
            raise ValueError(f"graph_optimization must be one of {OPTIMIZATION_LEVELS}, got {graph_optimization!r}")
        self.path = Path(path)
        requested = list(providers) if providers else providers_for(device)
        options = ort.SessionOptions()
        # threads sleep between runs instead of spinning: a server runs torch and other sessions beside this one
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        options.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[graph_optimization]
        options.intra_op_num_threads = threads
        options.enable_cpu_mem_arena = memory_arena
        # batch sizes vary from call to call (adaptive batching): a memory pattern is planned and kept per input
        # shape, which costs more memory than it saves time (measured: 127 vs 194 MB RSS over random batches)
        options.enable_mem_pattern = False
        options.log_severity_level = 3  # errors only: provider fallbacks are checked and reported below
        try:
            with warnings.catch_warnings():  # "provider not available": checked and reported below
                warnings.filterwarnings("ignore", message="Specified provider", category=UserWarning)
                self.session = ort.InferenceSession(str(self.path), options, providers=requested)
        except Exception as e:  # onnxruntime raises its own pybind exception types
            raise RuntimeLoadError(f"{self.path} is not a loadable ONNX model ({type(e).__name__}: {e}); "
                                   "is it truncated? Re-export it with `capserve export onnx`") from e  # fmt: skip
        active = self.session.get_providers()
        if _name(requested[0]) not in active:
            raise RuntimeLoadError(
                f"{_name(requested[0])} was requested but the session runs on {active} "
                f"(available in this onnxruntime: {ort.get_available_providers()}). onnxruntime-gpu falls back to CPU "
                "when CUDA, cuDNN or TensorRT libraries or the GPU are missing: install the versions it needs, "
                "or use device='cpu'"
            )
        self.metadata = self._read_metadata()
        self.precision = self.session.get_modelmeta().custom_metadata_map.get(PRECISION_KEY, "fp32")
        inputs = self.session.get_inputs()
        outputs = [o.name for o in self.session.get_outputs()]
        if len(inputs) != 1 or LOGITS not in outputs:
            raise RuntimeLoadError(
                f"{self.path} has inputs {[i.name for i in inputs]} and outputs {outputs}; "
                f"expected one image input and a {LOGITS!r} output (`capserve export onnx`)"
            )
        self.input_name = inputs[0].name
        if inputs[0].type != "tensor(float)" or list(inputs[0].shape[1:]) != list(self.metadata.input_shape):
            raise RuntimeLoadError(f"{self.path}: input {inputs[0].type} {inputs[0].shape} does not match its "
                                   f"metadata's float (B, {self.metadata.input_shape}); re-export it")  # fmt: skip
        self.explainable = PART_WHOLE in outputs

    def _read_metadata(self) -> ModelMetadata:
        props = self.session.get_modelmeta().custom_metadata_map
        if METADATA_KEY not in props:
            raise RuntimeLoadError(
                f"{self.path} has no {METADATA_KEY!r} metadata: export it with `capserve export onnx`, "
                "which records labels, input size and normalisation"
            )
        return ModelMetadata.from_json(props[METADATA_KEY])

    @property
    def providers(self) -> list[str]:
        return self.session.get_providers()

    def _predict(self, batch: np.ndarray) -> np.ndarray:
        return self.session.run([LOGITS], {self.input_name: batch})[0]

    def explain(self, batch: np.ndarray) -> Explanation:
        if not self.explainable:
            if self.metadata.iterations is None:
                raise NotImplementedError(f"{self.path} is a CNN without routing: there is nothing to explain")
            raise NotImplementedError(f"{self.path} has no {PART_WHOLE!r} output: export it with "
                                      "`capserve export onnx --explain`")  # fmt: skip
        logits, parse = self.session.run([LOGITS, PART_WHOLE], {self.input_name: self.check_batch(batch)})
        return Explanation(logits, parse)
