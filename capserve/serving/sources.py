"""Where the served models come from: a model directory, an .onnx or engine file, or a tag in BentoML's model store."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from capserve.errors import ConfigurationError, PrecisionError, RuntimeLoadError
from capserve.runtime import Runtime, load_runtime
from capserve.runtime.precision import open_torch, resolve_precision
from capserve.serving.batching import lone_request_options
from capserve.serving.settings import Settings

log = logging.getLogger(__name__)

ARTIFACTS = {"onnxruntime": "model.onnx", "tensorrt": "model.plan"}


EXPLAIN_ARTIFACT = "model-explain.onnx"


STORE_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(:[A-Za-z0-9_.-]+)?$")  # BentoML's NAME[:VERSION]


@dataclass(frozen=True)
class ModelSource:
    """Where a served model came from: its folder, and its BentoML model-store tag when it came from the store."""

    path: Path
    tag: str | None = None


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


def open_model(spec: str, settings: Settings) -> tuple[Runtime, Runtime | None, ModelSource]:
    """The runtime for predictions, the one for explanations (None when the model has none), and the source."""
    source = resolve_model(spec)
    path = source.path
    artifact_file = path.is_file() and settings.backend != "torch"  # the artifact itself, e.g. an int8 .onnx
    if not path.is_dir() and not artifact_file:
        home = os.environ.get("BENTOML_HOME", "~/bentoml")
        raise ConfigurationError(f"model {spec!r} is neither a directory (working directory {Path.cwd()}) nor a "
                                 f"model in BentoML's model store ({home}): set CAPSERVE_MODEL / "
                                 "CAPSERVE_MULTILABEL_MODEL to a directory made by `capserve train` or "
                                 "model.save(dir), or save one to the store with `capserve export bentoml DIR "
                                 "--name NAME`")  # fmt: skip
    try:
        if settings.backend == "torch":
            runtime, _ = open_torch(path, settings.device, settings.iterations, settings.precision,
                                    settings.bf16_min_agreement)  # fmt: skip
            return runtime, runtime if has_routing(runtime) else None, source
        artifact = path if artifact_file else path / ARTIFACTS[settings.backend]
        if not artifact.is_file():
            fix = (f"capserve export onnx {path} -o {artifact}" if settings.backend == "onnxruntime"
                   else f"capserve export tensorrt {path / 'model.onnx'} -o {artifact}")  # fmt: skip
            raise ConfigurationError(f"{path} has no {artifact.name}, which the {settings.backend} backend "
                                     f"serves: run `{fix}` first, or set CAPSERVE_BACKEND=torch")  # fmt: skip
        runtime = load_runtime(artifact, settings.backend, settings.device, **lone_request_options(settings))
        _, runtime.precision_reason = resolve_precision(settings.precision, settings.backend, settings.device)
        explainer = None
        if (path / EXPLAIN_ARTIFACT).is_file():
            explainer = load_runtime(path / EXPLAIN_ARTIFACT, "onnxruntime", settings.device)
            explainer.precision_reason = runtime.precision_reason
        elif has_routing(runtime):
            log.warning("%s has no %s: /explain is off (run `capserve export onnx %s -o %s --explain`)", path,
                        EXPLAIN_ARTIFACT, path, path / EXPLAIN_ARTIFACT)  # fmt: skip
        return runtime, explainer, source
    except (RuntimeLoadError, ValueError) as e:
        if isinstance(e, ConfigurationError):
            raise
        if isinstance(e, PrecisionError):
            raise ConfigurationError(f"CAPSERVE_PRECISION={settings.precision}: {e}") from e
        raise ConfigurationError(f"cannot load the model in {path} with the {settings.backend} backend: {e}") from e
