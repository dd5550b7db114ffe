"""ONNX Runtime backend: an .onnx file written by ``capserve export onnx``, on CPU, CUDA or TensorRT providers."""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from capserve.configs import MODELS, CapsuleLayerConfig, ModelConfig
from capserve.errors import RuntimeLoadError
from capserve.hardware import cpu_info
from capserve.routing.registry import ROUTINGS, update_is_read
from capserve.runtime.base import Explanation, Runtime, in_worker_thread
from capserve.runtime.metadata import (
    CLASS_POSES,
    CONFIG_KEY,
    INT8_CHECK_KEY,
    LOGITS,
    METADATA_KEY,
    PART_WHOLE,
    PRECISION_KEY,
    Int8Check,
    ModelMetadata,
)
from capserve.runtime.precision import agreement

log = logging.getLogger(__name__)


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


# An exported graph routes a whole batch at once: every vote of a routed layer lives in one tensor, beside its
# products with the parents and the weighted votes. Batches run in chunks whose votes fit this budget.
MEMORY_BUDGET_MB = 512


# ONNX Runtime's peak over its base, per vote byte of the routed layers (the votes, their products with the parents
# and the weighted votes), rounded up so that a chunk stays inside the budget (docs/benchmarks/memory.md)
VOTE_COPIES = 3


def vote_bytes_per_image(config: ModelConfig, iterations: int | None, element_size: int = 4) -> int:
    """Bytes of the votes (positions × children × parents × D) of every capsule layer that builds them at
    T = ``iterations``, per image: 0 for a CNN, and 0 at T = 1 for attention and dynamic routing, whose first
    iteration routes uniformly without votes (EM's M-step reads every vote at any T).

    Summed over layers because a concurrent update computes every layer's step from the same poses, and a runtime
    may hold them at once. Follows ``CapsNet.route``: sequential routing routes every layer when T >= 2; concurrent
    routing routes layer i only if its iteration-2 update is read (``update_is_read``).
    """
    if iterations is None or not config.has_routing:
        return 0
    layers = (*config.capsules, CapsuleLayerConfig("fc", config.num_classes))
    side, types, total = config.spatial_sizes[0], config.primary_types, 0
    for i, layer in enumerate(layers):
        if layer.kind == "conv":
            children = layer.kernel_size**2 * types
            side = (side - layer.kernel_size) // layer.stride + 1
            positions = side**2
        else:
            children, positions, side = types * side**2, 1, 1
        routes = iterations >= 2 if config.routing == "sequential" else update_is_read(i, 2, len(layers), iterations)
        routes = routes or ROUTINGS[config.routing_algorithm].votes_at_first_iteration
        if routes:
            total += positions * children * layer.types * config.pose_dim * element_size
        types = layer.types
    return total


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


def import_onnxruntime() -> Any:
    """The ``onnxruntime`` module (``RuntimeLoadError`` when it is missing, or installed twice: CPU and GPU)."""
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise RuntimeLoadError(
            "onnxruntime is not installed: pip install 'capserve[export]' "
            "(or 'capserve[gpu]' for onnxruntime-gpu on NVIDIA machines)"
        ) from e
    if len(installed_onnxruntimes()) > 1:
        raise RuntimeLoadError(
            "both onnxruntime and onnxruntime-gpu are installed: they install one module, "
            "and mixed they leave no working CUDA provider. GPU machines: `pip uninstall -y "
            "onnxruntime onnxruntime-gpu && pip install 'capserve[gpu]'`; CPU machines: "
            "`pip uninstall -y onnxruntime-gpu onnxruntime && pip install "
            "'capserve[serve]'`"
        )
    return ort


def session_options(ort: Any, graph_optimization: str, threads: int, memory_arena: bool, spinning: bool) -> Any:
    """``onnxruntime.SessionOptions`` as ``OnnxRuntime`` documents its arguments."""
    options = ort.SessionOptions()
    # by default threads sleep between runs instead of spinning: a server runs torch and other sessions beside it
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "1" if spinning else "0")
    options.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[graph_optimization]
    options.intra_op_num_threads = threads
    options.enable_cpu_mem_arena = memory_arena
    # batch sizes vary from call to call (adaptive batching): a memory pattern is planned and kept per input
    # shape, which costs more memory than it saves time (docs/benchmarks/memory.md)
    options.enable_mem_pattern = False
    options.log_severity_level = 3  # errors only: provider fallbacks are checked and reported in OnnxRuntime
    return options


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
            process (an arena holds its peak).
        memory_budget_mb: run a batch in chunks of at most ``chunk_size`` images, chosen so that a chunk's votes
            fit this budget (``vote_bytes_per_image`` × ``VOTE_COPIES``); None runs every batch whole. The results
            are those of one run: images never interact.
        spinning: let the intra-op threads spin between an operator's parallel sections instead of sleeping, as
            ONNX Runtime does by default: the lowest latency for one run at a time, but a spinning thread takes a
            core from anything else running, so off unless the caller runs this session alone.
        int8_check: an INT8 graph re-checks its decisions on the inputs its export recorded (``check_int8``) and
            is refused (``RuntimeLoadError``) where they fall below its gate's bound, or where it records none.
            False only for graphs being made or measured (the exporter, ``capserve verify --int8``).
    """

    backend = "onnxruntime"

    def __init__(
        self,
        path: str | Path,
        device: str = "cpu",
        providers: list[Provider] | None = None,
        graph_optimization: str = "all",
        threads: int = 0,
        memory_arena: bool = True,
        memory_budget_mb: float | None = MEMORY_BUDGET_MB,
        spinning: bool = False,
        int8_check: bool = True,
    ):
        ort = import_onnxruntime()
        if graph_optimization not in OPTIMIZATION_LEVELS:
            raise ValueError(f"graph_optimization must be one of {OPTIMIZATION_LEVELS}, got {graph_optimization!r}")
        self.path = Path(path)
        requested = list(providers) if providers else providers_for(device)
        options = session_options(ort, graph_optimization, threads, memory_arena, spinning)
        self.session = self._open_session(ort, options, requested)
        self.metadata = self._read_metadata()
        self.precision = self.session.get_modelmeta().custom_metadata_map.get(PRECISION_KEY, "fp32")
        self.input_name, self.explainable = self._check_inputs_and_outputs()
        self.chunk_size = self._chunk_size(memory_budget_mb)
        if self.precision == "int8" and int8_check:
            self.precision_reason = check_int8(self)

    def _open_session(self, ort: Any, options: Any, requested: list[Provider]) -> Any:
        """The session on ``requested`` providers (``RuntimeLoadError`` when the file does not load, or when it runs
        on another provider than the first requested)."""
        try:
            with warnings.catch_warnings():  # "provider not available": checked and reported below
                warnings.filterwarnings("ignore", message="Specified provider", category=UserWarning)
                session = ort.InferenceSession(str(self.path), options, providers=requested)
        except Exception as e:  # onnxruntime raises its own pybind exception types
            raise RuntimeLoadError(
                f"{self.path} is not a loadable ONNX model ({type(e).__name__}: {e}); "
                "is it truncated? Re-export it with `capserve export onnx`"
            ) from e
        active = session.get_providers()
        if _name(requested[0]) not in active:
            raise RuntimeLoadError(
                f"{_name(requested[0])} was requested but the session runs on {active} "
                f"(available in this onnxruntime: {ort.get_available_providers()}). onnxruntime-gpu falls back to CPU "
                "when CUDA, cuDNN or TensorRT libraries or the GPU are missing: install the versions it needs, "
                "or use device='cpu'"
            )
        return session

    def _check_inputs_and_outputs(self) -> tuple[str, bool]:
        """The image input's name, checked against the metadata, and whether the graph has the part-whole output
        (``RuntimeLoadError`` for a graph ``capserve export onnx`` did not write)."""
        inputs = self.session.get_inputs()
        outputs = [o.name for o in self.session.get_outputs()]
        if len(inputs) != 1 or LOGITS not in outputs:
            raise RuntimeLoadError(
                f"{self.path} has inputs {[i.name for i in inputs]} and outputs {outputs}; "
                f"expected one image input and a {LOGITS!r} output (`capserve export onnx`)"
            )
        if inputs[0].type != "tensor(float)" or list(inputs[0].shape[1:]) != list(self.metadata.input_shape):
            raise RuntimeLoadError(
                f"{self.path}: input {inputs[0].type} {inputs[0].shape} does not match its "
                f"metadata's float (B, {self.metadata.input_shape}); re-export it"
            )
        self.has_class_poses = CLASS_POSES in outputs
        return inputs[0].name, PART_WHOLE in outputs

    def _config(self) -> ModelConfig | None:
        """The exported architecture: from the file, or for files exported before it was recorded there, the named
        config with the metadata's labels and input (None when neither describes this graph)."""
        props = self.session.get_modelmeta().custom_metadata_map
        if CONFIG_KEY in props:
            try:
                return ModelConfig.from_dict(json.loads(props[CONFIG_KEY]))
            except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
                raise RuntimeLoadError(
                    f"{self.path}: {CONFIG_KEY!r} is not a valid model config ({e}); "
                    "re-export it with `capserve export onnx`"
                ) from e
        m = self.metadata
        if m.name not in MODELS:
            return None
        try:
            return dataclasses.replace(
                MODELS[m.name], labels=m.labels, in_channels=m.in_channels, image_size=m.image_size
            )
        except ValueError:
            return None

    def _chunk_size(self, budget_mb: float | None) -> int | None:
        if budget_mb is None:
            return None
        if budget_mb <= 0:
            raise ValueError(f"memory_budget_mb must be > 0 (or None: no chunks), got {budget_mb!r}")
        config = self._config()
        if config is None:
            log.warning("%s records no model config: batches run whole (memory grows with the batch)", self.path)
            return None
        element_size = 2 if self.precision == "fp16" else 4
        per_image = VOTE_COPIES * vote_bytes_per_image(config, self.metadata.iterations, element_size)
        return None if per_image == 0 else max(1, int(budget_mb * 2**20 // per_image))

    def _run(self, names: list[str], batch: np.ndarray) -> list[np.ndarray]:
        """``session.run`` over chunks of at most ``chunk_size`` images, outputs concatenated along the batch."""
        chunk = self.chunk_size
        if chunk is None or len(batch) <= chunk:
            return self.session.run(names, {self.input_name: batch})
        parts = [self.session.run(names, {self.input_name: batch[i : i + chunk]}) for i in range(0, len(batch), chunk)]
        return [np.concatenate(outputs) for outputs in zip(*parts, strict=True)]

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
        return self._run([LOGITS], batch)[0]

    def infer(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        if not self.has_class_poses:
            return self.predict(batch), None
        logits, poses = self._run([LOGITS, CLASS_POSES], self.check_batch(batch))
        return logits, poses

    def explain(self, batch: np.ndarray) -> Explanation:
        if not self.explainable:
            if self.metadata.iterations is None:
                raise NotImplementedError(f"{self.path} is a CNN without routing: there is nothing to explain")
            raise NotImplementedError(
                f"{self.path} has no {PART_WHOLE!r} output: export it with `capserve export onnx --explain`"
            )
        logits, parse = self._run([LOGITS, PART_WHOLE], self.check_batch(batch))
        return Explanation(logits, parse)


def check_int8(runtime: OnnxRuntime) -> str:
    """The start-up check of an INT8 graph on the machine that opens it: its decisions on the calibration images its
    export recorded (``Int8Check``), against their fp32 decisions. An int8 graph whose decisions depend on the CPU's
    int8 kernels (16-bit saturation without VNNI, other rounding) is served only where it agrees at least as well
    as its export gate's bound; else ``RuntimeLoadError`` says what was measured and what to do instead.

    Returns the line that ``GET /model``'s precision reason and the log show."""
    props = runtime.session.get_modelmeta().custom_metadata_map
    redo = (
        f"re-export it on this machine (`capserve export onnx MODEL_DIR -o {runtime.path.name} --int8 "
        "--calibration DATA`) or serve the fp32 graph"
    )
    if INT8_CHECK_KEY not in props:
        raise RuntimeLoadError(
            f"{runtime.path} is an int8 graph without the inputs it re-checks on the machine that serves it "
            f"(made by an older capserve, or not by `capserve export onnx --int8`): {redo}"
        )
    record = Int8Check.from_json(props[INT8_CHECK_KEY])
    meta = runtime.metadata
    if record.shape[1:] != meta.input_shape or len(record.fp32_logits[0]) != len(meta.labels):
        raise RuntimeLoadError(f"{runtime.path}: {INT8_CHECK_KEY!r} does not fit the model's input or labels: {redo}")
    from capserve.data.preprocess import normalize_numpy  # torch-backed module: imported only for int8 graphs

    images = normalize_numpy(record.images(), meta.mean, meta.std)  # (N, C, H, W)
    logits = in_worker_thread(lambda: runtime.predict_in_batches(images, 64), "capserve-int8-check")  # (N, C)
    fp32, exported = np.asarray(record.fp32_logits), np.asarray(record.int8_logits)  # (N, classes)
    agreed = agreement(fp32, logits, meta)
    drift = float(np.abs(logits.astype(np.float64) - exported).max())
    measured = (
        f"int8 decides as fp32 on {agreed:.4f} of the {len(images)} images its export recorded (bound "
        f"{record.bound:g}, its export gate's; max |Δlogit| {drift:.3g} from the int8 logits of the exporting "
        f"machine, {record.cpu})"
    )
    if agreed < record.bound:
        raise RuntimeLoadError(
            f"{runtime.path} is not served on this CPU ({cpu_info().describe()}): {measured}; its int8 kernels "
            f"compute otherwise: {redo}"
        )
    log.debug("%s: int8 verified on this machine: %s", runtime.path, measured)  # GET /model says it too
    return f"int8 verified on this machine: {measured}"
