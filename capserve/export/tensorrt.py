"""Build a TensorRT engine from an exported ONNX file, with the JSON sidecar the TensorRT runtime checks.

TensorRT 10 and 11 Python API: an explicit-batch network (``create_network(0)``; strongly typed when the
graph is FP16 so that its precision is the graph's), ``OnnxParser`` with every error reported by node name,
one optimisation profile over the batch axis, an optional timing cache file, ``build_serialized_network``.

FP16: TensorRT 11 has no FP16 builder flag, so ``fp16=True`` converts an FP32 graph with
``capserve.export.fp16`` (LayerNormalization and Softmax stay FP32) before parsing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capserve.errors import ExportError, RuntimeLoadError
from capserve.files import partial_file
from capserve.hashing import sha256_bytes
from capserve.runtime.metadata import METADATA_KEY, PRECISION_KEY, ModelMetadata
from capserve.runtime.tensorrt_backend import TENSORRT_MISSING, EngineSidecar, gpu_name, sidecar_path

from .onnx import read_metadata, set_metadata

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OnnxSource:
    """What the engine builder needs to know about its ONNX file, read without TensorRT."""

    data: bytes
    sha256: str
    input_name: str
    input_shape: tuple[int, ...]  # (C, H, W)
    outputs: tuple[str, ...]
    precision: str
    metadata: ModelMetadata


def check_batch_range(min_batch: int, opt_batch: int, max_batch: int) -> None:
    if not 1 <= min_batch <= opt_batch <= max_batch:
        raise ExportError(
            f"batch sizes need 1 <= --min-batch <= --opt-batch <= --max-batch, got {min_batch}, "
            f"{opt_batch}, {max_batch}"
        )


def read_onnx(path: str | Path, fp16: bool = False) -> OnnxSource:
    """Read and check a capserve ONNX file; with ``fp16``, convert an FP32 graph to FP16 in memory."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path} not found: export one with `capserve export onnx CHECKPOINT -o {path}`")
    data = path.read_bytes()
    sha = sha256_bytes(data)
    try:
        proto = onnx.load_model_from_string(data)
        onnx.checker.check_model(proto)
    except Exception as e:  # protobuf DecodeError, onnx ValidationError
        raise ExportError(f"{path} is not a valid ONNX model ({type(e).__name__}: {e}); is it truncated?") from e
    props = read_metadata(proto)
    if METADATA_KEY not in props:
        raise ExportError(f"{path} has no {METADATA_KEY!r} metadata: export it with `capserve export onnx`")
    try:
        metadata = ModelMetadata.from_json(props[METADATA_KEY])
    except RuntimeLoadError as e:
        raise ExportError(f"{path}: {e}") from e
    precision = props.get(PRECISION_KEY, "fp32")
    if fp16 and precision != "fp16":
        from capserve.export.fp16 import convert_to_fp16

        proto = convert_to_fp16(proto)
        set_metadata(proto, {**read_metadata(proto), PRECISION_KEY: "fp16"})
        data, precision = proto.SerializeToString(), "fp16"
    (inp,) = proto.graph.input
    dims = tuple(d.dim_value for d in inp.type.tensor_type.shape.dim[1:])
    return OnnxSource(data, sha, inp.name, dims, tuple(o.name for o in proto.graph.output), precision, metadata)


def parser_errors(parser: Any) -> str:
    """All of an OnnxParser's errors, one line each, with the failing node's name and operator."""
    lines = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        name = e.node_name() if hasattr(e, "node_name") else ""
        operator = e.node_operator() if hasattr(e, "node_operator") else ""
        lines.append(f"  node {e.node()} {name!r} ({operator}): {e.desc()}")
    return "\n".join(lines)


def build_engine(
    onnx_path: str | Path,
    engine_path: str | Path,
    min_batch: int = 1,
    opt_batch: int = 16,
    max_batch: int = 64,
    *,
    timing_cache: str | Path | None = None,
    fp16: bool = False,
    workspace_gib: float = 4.0,
    tf32: bool = False,
    int8: bool = False,
) -> Path:
    """Build and write a serialised engine for ``onnx_path`` and its sidecar ``engine_path + '.json'``.

    Args:
        min_batch, opt_batch, max_batch: the optimisation profile of the batch axis.
        timing_cache: file read if present and written after the build (faster rebuilds on the same GPU).
        fp16: build from an FP16 version of an FP32 graph (see module docstring).
        workspace_gib: builder workspace memory limit.
        tf32: allow TF32 matrix products (TensorRT 10 enables it by default; off here for FP32 parity).
        int8: ``onnx_path`` is an INT8 QDQ graph (``capserve.export.int8``, target tensorrt): explicit quantization,
            the INT8 flag on TensorRT 10 (11 takes precision from the Q/DQ layers); no calibrator, no cache.
    Returns:
        ``engine_path``.
    """
    check_batch_range(min_batch, opt_batch, max_batch)
    source = read_onnx(onnx_path, fp16)
    if int8 or source.precision == "int8":
        from capserve.export.quantize import check_tensorrt_int8

        check_tensorrt_int8(onnx_path, source.data, source.precision, fp16)
    try:
        import tensorrt as trt
    except ImportError as e:
        raise ExportError(TENSORRT_MISSING) from e
    try:
        gpu = gpu_name()
    except RuntimeLoadError as e:
        raise ExportError(str(e)) from e

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    major = int(trt.__version__.split(".")[0])
    # the parser owns the weights the network points to: it stays alive until the engine is built
    network, _parser = parse_network(trt, builder, logger, source, onnx_path, major)
    config = builder_config(trt, builder, source, (min_batch, opt_batch, max_batch), workspace_gib, tf32, major)
    cache_path = Path(timing_cache) if timing_cache else None
    if cache_path is not None:
        use_timing_cache(config, cache_path)

    log.info(
        "building a TensorRT %s engine for %s on %s (batch %d..%d)",
        trt.__version__,
        onnx_path,
        gpu,
        min_batch,
        max_batch,
    )
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError(f"TensorRT could not build an engine from {onnx_path} (see its log above)")
    engine = bytes(serialized)
    sidecar = engine_sidecar(trt.__version__, gpu, source, engine, (min_batch, opt_batch, max_batch))
    return write_engine(Path(engine_path), engine, sidecar, config, cache_path)


def parse_network(
    trt: Any, builder: Any, logger: Any, source: OnnxSource, onnx_path: str | Path, major: int
) -> tuple[Any, Any]:
    """An explicit-batch network parsed from ``source`` (strongly typed for an FP16 graph on TensorRT 10; 11 always
    is), and its parser (``ExportError`` with every parser error when it rejects the graph)."""
    flags = 0  # explicit batch is the only mode in TensorRT 10+
    if source.precision == "fp16" and major < 11 and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)  # precision from the graph (11: always)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(source.data):
        raise ExportError(f"TensorRT's ONNX parser rejected {onnx_path}:\n{parser_errors(parser)}")
    return network, parser


def builder_config(
    trt: Any,
    builder: Any,
    source: OnnxSource,
    batches: tuple[int, int, int],
    workspace_gib: float,
    tf32: bool,
    major: int,
) -> Any:
    """The builder config: the workspace limit, INT8 kernels for a Q/DQ graph on TensorRT 10, TF32 off unless
    ``tf32``, and one optimisation profile over the batch axis (``batches``: min, opt, max)."""
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    if source.precision == "int8" and major < 11:  # explicit quantization: the Q/DQ scales, INT8 kernels allowed
        config.set_flag(trt.BuilderFlag.INT8)
    if not tf32 and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)
    profile = builder.create_optimization_profile()
    chw = source.input_shape
    min_batch, opt_batch, max_batch = batches
    profile.set_shape(source.input_name, (min_batch, *chw), (opt_batch, *chw), (max_batch, *chw))
    config.add_optimization_profile(profile)
    return config


def use_timing_cache(config: Any, cache_path: Path) -> None:
    """Build with the timing cache at ``cache_path`` (a new one without the file); a warning when TensorRT ignores
    it."""
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    if not config.set_timing_cache(cache, ignore_mismatch=False):  # made elsewhere: TensorRT ignores it
        log.warning(
            "timing cache %s was made by another TensorRT version or GPU: ignored, and overwritten by this build's",
            cache_path,
        )


def engine_sidecar(
    tensorrt_version: str, gpu: str, source: OnnxSource, engine: bytes, batches: tuple[int, int, int]
) -> EngineSidecar:
    """What the TensorRT runtime checks before it loads ``engine`` (``batches``: min, opt, max)."""
    min_batch, opt_batch, max_batch = batches
    return EngineSidecar(
        tensorrt_version=tensorrt_version,
        gpu_name=gpu,
        onnx_sha256=source.sha256,
        engine_sha256=sha256_bytes(engine),
        min_batch=min_batch,
        opt_batch=opt_batch,
        max_batch=max_batch,
        input_name=source.input_name,
        outputs=source.outputs,
        precision=source.precision,
        metadata=source.metadata,
    )


def write_engine(
    engine_path: Path, engine: bytes, sidecar: EngineSidecar, config: Any, cache_path: Path | None
) -> Path:
    """Write the engine, the timing cache (``config``'s, when ``cache_path``) and the sidecar; ``engine_path``."""
    engine_path.parent.mkdir(parents=True, exist_ok=True)
    # each file renamed into place once whole: a build killed half-way leaves no partial engine, and an engine whose
    # sidecar is still the old one fails the runtime's engine_sha256 check instead of loading
    with partial_file(engine_path) as partial:
        partial.write_bytes(engine)
    if cache_path is not None:
        with partial_file(cache_path) as partial:
            partial.write_bytes(bytes(config.get_timing_cache().serialize()))
    with partial_file(sidecar_path(engine_path)) as partial:
        partial.write_text(sidecar.to_json())
    log.info("wrote %s and %s", engine_path, sidecar_path(engine_path))
    return engine_path
