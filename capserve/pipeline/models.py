"""Opening a model for predictions, for the service and ``capserve predict`` alike: where it comes from (a model
directory, an .onnx or engine file, or a tag in BentoML's model store) and the runtimes it is served with."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from capserve.errors import ConfigurationError, PrecisionError, RuntimeLoadError
from capserve.model.checkpoint import not_learned_warning
from capserve.runtime import Runtime, load_runtime
from capserve.runtime.familiarity import read_familiarity
from capserve.runtime.precision import BF16_MIN_AGREEMENT, open_torch, resolve_precision

log = logging.getLogger(__name__)

ARTIFACTS = {"onnxruntime": "model.onnx", "tensorrt": "model.plan"}


EXPLAIN_ARTIFACT = "model-explain.onnx"


STORE_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(:[A-Za-z0-9_.-]+)?$")  # BentoML's NAME[:VERSION]


class ModelOptions(Protocol):
    """What opening a model reads: the service's ``Settings`` or an ``OpenOptions``."""

    backend: str
    device: str
    precision: str
    iterations: int | None
    threads: int | None
    bf16_min_agreement: float
    artifact: str | None
    max_batch_size: int
    unfamiliar: bool


@dataclass(frozen=True)
class OpenOptions:
    """How to open a model outside the service (``capserve predict``), with the service's defaults."""

    backend: str = "onnxruntime"  # onnxruntime | torch | tensorrt
    device: str = "cpu"  # cpu | cuda | cuda:N
    precision: str = "auto"  # fp32 | bf16 (torch backend) | auto
    iterations: int | None = None  # torch backend only: routing iterations
    threads: int | None = None  # intra-op threads; None: all cores
    bf16_min_agreement: float = BF16_MIN_AGREEMENT  # bf16 start-up check: least agreement with fp32, else fp32
    artifact: str | None = None  # a graph in the folder other than model.onnx
    max_batch_size: int = 32  # the service's adaptive batching default: above 1, lone requests run apart
    unfamiliar: bool = True  # answers carry each image's unfamiliarity where the model has a calibration


@dataclass(frozen=True)
class ModelSource:
    """Where a served model came from: its folder, and its BentoML model-store tag when it came from the store."""

    path: Path
    tag: str | None = None


def lone_request_options(settings: ModelOptions) -> dict[str, Any]:
    """Options of the session that serves predictions. With adaptive batching on a CPU, ONNX Runtime batches run on
    their own session (``batch_runtime``) and this one mostly runs lone requests, one at a time: its threads may spin
    between an operator's parallel sections instead of sleeping and waking (ONNX Runtime's default, which every
    other session here turns off), which lowers a lone request's latency without costing throughput under load
    (docs/benchmarks/serving.md, "HTTP request path"). With batching off, concurrent requests share this session, and
    spinning threads would take the cores their peers need."""
    if settings.backend != "onnxruntime":
        return {}
    threads = {"threads": settings.threads} if settings.threads else {}  # the worker's share (None: all cores)
    batches_apart = settings.device == "cpu" and settings.max_batch_size > 1
    return {**threads, "spinning": True} if batches_apart else threads


def has_routing(runtime: Runtime) -> bool:
    """False for a CNN baseline: its metadata has no routing iterations (``ModelMetadata.iterations`` is None)."""
    return runtime.metadata.iterations is not None


def resolve_model(spec: str) -> ModelSource:
    """``CAPSERVE_MODEL``'s value → the model folder: a directory, or ``NAME[:VERSION]`` in BentoML's model store
    (``capserve export bentoml``; inside a bento, the store is the bento's own models folder)."""
    path = Path(spec)
    if path.exists() or not STORE_TAG.match(spec):
        return ModelSource(path)
    try:
        import bentoml
        from bentoml.exceptions import NotFound
    except ImportError:
        return ModelSource(path)
    try:
        stored = bentoml.models.get(spec)
    except NotFound:
        return ModelSource(path)  # open_model says that neither exists
    except ValueError as e:  # a malformed tag
        raise ConfigurationError(f"model {spec!r}: {e}") from e
    return ModelSource(Path(stored.path), str(stored.tag))


def open_model(spec: str, settings: ModelOptions, explain: bool = True) -> tuple[Runtime, Runtime | None, ModelSource]:
    """The runtime for predictions, the one for explanations (None when the model has none, or ``explain`` is False:
    the multi-label model, which /explain does not use), and the source. The runtime carries the model's
    unfamiliarity calibration (``familiarity.safetensors`` in its folder, or beside a graph file) unless
    ``settings.unfamiliar`` is off."""
    runtime, explainer, source = _open(spec, settings, explain)
    if settings.unfamiliar:
        folder = source.path if source.path.is_dir() else source.path.parent
        try:
            runtime.familiarity = read_familiarity(folder)
        except ValueError as e:
            raise ConfigurationError(f"{e}: fit it again with `capserve familiarity {folder} --data DATA`") from e
    return runtime, explainer, source


def _open(spec: str, settings: ModelOptions, explain: bool) -> tuple[Runtime, Runtime | None, ModelSource]:
    source = resolve_model(spec)
    path = source.path
    if path.is_file():
        runtime = _open_file(path, settings)
        return runtime, _file_explainer(path, settings, runtime) if explain else None, source
    if not path.is_dir():
        home = os.environ.get("BENTOML_HOME", "~/bentoml")
        raise ConfigurationError(
            f"model {spec!r} is neither a directory (working directory {Path.cwd()}) nor a "
            f"model in BentoML's model store ({home}): set CAPSERVE_MODEL / "
            "CAPSERVE_MULTILABEL_MODEL to a directory made by `capserve train` or "
            "model.save(dir), an exported .onnx file, or save one to the store with "
            "`capserve export bentoml DIR --name NAME`"
        )
    warning = not_learned_warning(path)
    if warning:
        log.warning("%s", warning)
    try:
        if settings.backend == "torch":
            runtime, _ = open_torch(
                path, settings.device, settings.iterations, settings.precision, settings.bf16_min_agreement
            )
            if settings.threads and settings.device == "cpu":
                # the worker's share of the cores (capserve.serving.workers), in whichever thread calls it
                runtime = runtime.with_threads(settings.threads)  # type: ignore[attr-defined]
            return runtime, runtime if explain and has_routing(runtime) else None, source
        # a tuned file may choose another graph in the folder for onnxruntime (an INT8 one, capserve.serving.tuned)
        named = settings.artifact if settings.backend == "onnxruntime" else None
        artifact = path / (named or ARTIFACTS[settings.backend])
        if not artifact.is_file():
            fix = (
                f"capserve export onnx {path} -o {artifact}"
                if settings.backend == "onnxruntime"
                else f"capserve export tensorrt {path / 'model.onnx'} -o {artifact}"
            )
            raise ConfigurationError(
                f"{path} has no {artifact.name}, which the {settings.backend} backend "
                f"serves: run `{fix}` first, or use the torch backend (CAPSERVE_BACKEND=torch to serve, "
                "--backend torch for capserve predict)"
            )
        runtime = load_runtime(artifact, settings.backend, settings.device, **lone_request_options(settings))
        runtime.precision_reason = precision_reason(runtime, settings)
        explainer = None
        if explain and (path / EXPLAIN_ARTIFACT).is_file():
            explainer = _open_explainer(path / EXPLAIN_ARTIFACT, settings)
        elif explain and has_routing(runtime):
            log.warning(
                "%s has no %s: /explain is off (run `capserve export onnx %s -o %s --explain`)",
                path,
                EXPLAIN_ARTIFACT,
                path,
                path / EXPLAIN_ARTIFACT,
            )
        return runtime, explainer, source
    except (RuntimeLoadError, ValueError) as e:
        if isinstance(e, ConfigurationError):
            raise
        if isinstance(e, PrecisionError):
            raise ConfigurationError(f"CAPSERVE_PRECISION={settings.precision}: {e}") from e
        raise ConfigurationError(f"cannot load the model in {path} with the {settings.backend} backend: {e}") from e


def precision_reason(runtime: Runtime, settings: ModelOptions) -> str:
    """Why ``runtime`` serves its precision, with what opening it checked (an int8 graph's start-up check)."""
    _, reason = resolve_precision(settings.precision, settings.backend, settings.device)
    return f"{reason}; {runtime.precision_reason}" if runtime.precision_reason else reason


def _open_file(path: Path, settings: ModelOptions) -> Runtime:
    """An exported artifact given as a file (``model.onnx``, ``model.plan``): the backend must be the one it is for."""
    wanted = ARTIFACTS.get(settings.backend)
    if wanted is None or path.suffix != Path(wanted).suffix:
        kinds = ", ".join(f"{Path(a).suffix} ({b})" for b, a in ARTIFACTS.items())
        raise ConfigurationError(
            f"model {str(path)!r} is a file, which the {settings.backend} backend cannot serve: "
            f"give a {kinds} file with its backend, or a model directory"
        )
    try:
        runtime = load_runtime(path, settings.backend, settings.device, **lone_request_options(settings))
        runtime.precision_reason = precision_reason(runtime, settings)
    except (RuntimeLoadError, ValueError) as e:
        if isinstance(e, ConfigurationError):
            raise
        raise ConfigurationError(f"cannot load {path} with the {settings.backend} backend: {e}") from e
    return runtime


def _file_explainer(path: Path, settings: ModelOptions, runtime: Runtime) -> Runtime | None:
    """The explanation graph exported next to an artifact file (``NAME-explain.onnx`` beside ``NAME.onnx``), when it
    was exported from the same weights; else None (/explain off)."""
    sibling = path.with_name(f"{path.stem}-explain.onnx")
    if not sibling.is_file() or not has_routing(runtime):
        return None
    try:
        explainer = _open_explainer(sibling, settings)
    except (RuntimeLoadError, ValueError) as e:
        raise ConfigurationError(f"cannot load the explanation graph {sibling}: {e}") from e
    if explainer.metadata.weights_sha256 != runtime.metadata.weights_sha256:
        log.warning("%s was exported from other weights than %s: /explain is off", sibling, path)
        return None
    return explainer


def _open_explainer(graph: Path, settings: ModelOptions) -> Runtime:
    """The explanation graph ``graph``, on the worker's share of the cores as the predictions' runtime is
    (``settings.threads``; 0: ONNX Runtime's default, every core)."""
    return load_runtime(graph, "onnxruntime", settings.device, threads=settings.threads or 0)
