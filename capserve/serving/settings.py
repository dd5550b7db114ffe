"""``Settings``: every ``CAPSERVE_*`` environment variable the service reads, parsed and checked once.

BentoML 1.4.40's configuration (``services.*``, ``BENTOML_CONFIG``) covers its own server only: workers, traffic,
logging, metrics, never a model, backend, precision or capserve's limits. What BentoML does take from capserve
(workers, batching limits, the access log) is passed to its decorators from these settings at import."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from capserve.data.images import DEFAULT_MAX_PIXELS
from capserve.errors import ConfigurationError
from capserve.runtime import BACKENDS
from capserve.runtime.precision import BF16_MIN_AGREEMENT, PRECISIONS

__all__ = ["API_KEYS_FORMAT", "DEFAULT_WORKERS", "Settings", "api_keys", "bento_environment"]

# CAPSERVE_WORKERS's default: "auto" (capserve.serving.workers.worker_count: the tuned file's, else one on a CPU);
# docs/deploy.md ("Workers") has what was measured
DEFAULT_WORKERS: int | None = None


# ---------------------------------------------------------------------------------------------------- settings


def _int(env: Mapping[str, str], name: str, default: int | None, minimum: int) -> int | None:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigurationError(f"{name}={text!r} is not an integer") from None
    if value < minimum:
        raise ConfigurationError(f"{name}={value} must be >= {minimum}")
    return value


@dataclass(frozen=True)
class Settings:
    """Service settings, each from the environment variable ``CAPSERVE_<FIELD>``."""

    model: str = "models/cifar10"  # single-label model directory (/classify, /classify_batch, /explain)
    multilabel_model: str = "models/multimnist"  # multi-label model directory (/multilabel); "none": no endpoint
    backend: str = "onnxruntime"  # onnxruntime | torch | tensorrt
    device: str = "cpu"  # cpu | cuda | cuda:N
    iterations: int | None = None  # torch backend only: routing iterations (ONNX/TensorRT fix T at export)
    precision: str = "auto"  # fp32 | bf16 (torch backend) | auto: bf16 where the CPU has native bf16 and torch serves
    bf16_min_agreement: float = BF16_MIN_AGREEMENT  # bf16 start-up check: least agreement with fp32, else fp32
    max_batch_size: int = 32  # adaptive batching: largest merged batch; 1 turns batching off
    max_latency_ms: int = 10_000  # adaptive batching: a request expected to wait longer is shed with a 503
    max_bytes: int = 8 * 2**20  # request body limit (413 above it)
    max_pixels: int = DEFAULT_MAX_PIXELS  # decoded image limit (413 above it: decompression bombs)
    max_images: int = 64  # images in one /classify_batch request
    workers: int | None = DEFAULT_WORKERS  # server processes (capserve.serving.workers); None: "auto"
    threads: int | None = None  # intra-op threads per worker; None: the worker's share of the cores
    access_log: bool = False  # BentoML's access log line per request (it costs the event loop: off)
    ui: bool = True  # the web page at /ui (capserve.serving.ui); False: /ui is a 404
    # when nothing chose the runtime: serve the fastest here, measured at start-up (capserve.serving.runtimes)
    measure_runtimes: bool = True
    # answers say how unlike the model's training images each image is (capserve.runtime.familiarity); False: null
    unfamiliar: bool = True
    # the keys a caller may send as ``Authorization: Bearer KEY``; empty: the server is open (repr=False: never logged)
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # the graph file in the model folder that onnxruntime serves (None: model.onnx); set by a tuned file only
    artifact: str | None = None
    # where each choice a tuned file may make came from: CAPSERVE_<NAME>, "default" or "tuned (FILE NAME, CPU)"
    # (capserve.serving.tuned.apply_tuned; empty until it ran)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        d = cls()
        backend = env.get("CAPSERVE_BACKEND", d.backend).strip() or d.backend
        if backend not in BACKENDS:
            raise ConfigurationError(f"CAPSERVE_BACKEND={backend!r}; choose one of: {', '.join(BACKENDS)}")
        settings = cls(
            model=env.get("CAPSERVE_MODEL", "").strip() or d.model,
            multilabel_model=env.get("CAPSERVE_MULTILABEL_MODEL", "").strip() or d.multilabel_model,
            backend=backend,
            device=env.get("CAPSERVE_DEVICE", "").strip() or d.device,
            iterations=_int(env, "CAPSERVE_ITERATIONS", None, 1),
            max_batch_size=_int(env, "CAPSERVE_MAX_BATCH_SIZE", d.max_batch_size, 1),
            max_latency_ms=_int(env, "CAPSERVE_MAX_LATENCY_MS", d.max_latency_ms, 1),
            max_bytes=_int(env, "CAPSERVE_MAX_BYTES", d.max_bytes, 1024),
            max_pixels=_int(env, "CAPSERVE_MAX_PIXELS", d.max_pixels, 64),
            max_images=_int(env, "CAPSERVE_MAX_IMAGES", d.max_images, 1),
            precision=env.get("CAPSERVE_PRECISION", "").strip().lower() or d.precision,
            bf16_min_agreement=_fraction(env, "CAPSERVE_BF16_MIN_AGREEMENT", d.bf16_min_agreement),
            access_log=_flag(env, "CAPSERVE_ACCESS_LOG", d.access_log),
            ui=_flag(env, "CAPSERVE_UI", d.ui),
            measure_runtimes=_flag(env, "CAPSERVE_MEASURE_RUNTIMES", d.measure_runtimes),
            unfamiliar=_flag(env, "CAPSERVE_UNFAMILIAR", d.unfamiliar),
            workers=_workers(env, d.workers),
            threads=_int(env, "CAPSERVE_THREADS", None, 1),
            api_keys=api_keys(env.get("CAPSERVE_API_KEYS", "")),
        )
        if settings.precision not in PRECISIONS:
            raise ConfigurationError(
                f"CAPSERVE_PRECISION={settings.precision!r}; choose one of: {', '.join(PRECISIONS)}"
            )
        if settings.precision == "bf16" and backend != "torch":
            raise ConfigurationError(
                f"CAPSERVE_PRECISION=bf16 works with the torch backend only: {backend} serves "
                "the precision of its exported graph. Set CAPSERVE_BACKEND=torch, or "
                "CAPSERVE_PRECISION=fp32 or auto"
            )
        if settings.iterations is not None and backend != "torch":
            raise ConfigurationError(
                f"CAPSERVE_ITERATIONS works with the torch backend only: {backend} artifacts "
                "fix the routing iterations at export; re-export with `capserve export onnx DIR "
                "-o DIR/model.onnx -T N` or unset CAPSERVE_ITERATIONS"
            )
        return settings


def _workers(env: Mapping[str, str], default: int | None) -> int | None:
    text = env.get("CAPSERVE_WORKERS", "").strip().lower()
    if text == "auto":
        return None
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigurationError(f"CAPSERVE_WORKERS={text!r}: give a number of workers or 'auto'") from None
    if value < 1:
        raise ConfigurationError(f"CAPSERVE_WORKERS={value} must be >= 1 (or 'auto')")
    return value


def bento_environment(module_file: str | Path) -> dict[str, str]:
    """The ``envs`` of the bento whose source holds ``module_file`` (``BENTO/src/capserve/serving/service.py`` →
    ``BENTO/bento.yaml``); {} outside a bento.

    A container built from the bento sets them (Dockerfile ENV), but BentoML 1.4.40's ``bentoml serve
    NAME:VERSION`` on a machine does not, and the service would look for ``models/cifar10`` and stop. The service
    takes them as defaults that the real environment overrides. Fixed upstream when ``bentoml serve`` of a built
    bento sets its ``envs`` (tests/serving/test_service.py's ``test_bentoml_build`` then passes without this)."""
    for folder in Path(module_file).resolve().parents:
        if folder.name == "src" and (folder.parent / "bento.yaml").is_file():
            import yaml  # a dependency of BentoML, which wrote the file

            info = yaml.safe_load((folder.parent / "bento.yaml").read_text()) or {}
            return {str(e["name"]): str(e.get("value", "")) for e in info.get("envs") or [] if "name" in e}
    return {}


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    text = env.get(name, "").strip().lower()
    if not text:
        return default
    if text not in ("0", "1", "true", "false"):
        raise ConfigurationError(f"{name}={text!r}: use 1 or 0")
    return text in ("1", "true")


def _fraction(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ConfigurationError(f"{name}={text!r} is not a number") from None
    if not 0 <= value <= 1:
        raise ConfigurationError(f"{name}={value} must be in [0, 1]")
    return value


API_KEYS_FORMAT = (
    "CAPSERVE_API_KEYS: one or more keys separated by commas, or @FILE for a file with one key a line "
    "(blank lines and lines starting with # are skipped)"
)


def api_keys(text: str) -> tuple[str, ...]:
    """``CAPSERVE_API_KEYS``'s value → the keys: ``KEY[,KEY...]``, or ``@FILE`` (one key a line). Empty: no keys.

    A file is named with ``@`` (as curl does) rather than guessed from the value, so that a mistyped path is an
    error instead of a key. Messages never quote a key."""
    text = text.strip()
    if not text:
        return ()
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigurationError(f"CAPSERVE_API_KEYS={text}: cannot read the key file ({e})") from None
        keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        where = f"the key file {path}"
    else:
        keys = [key.strip() for key in text.split(",") if key.strip()]
        where = "CAPSERVE_API_KEYS"
    if not keys:
        raise ConfigurationError(f"{where} holds no key; {API_KEYS_FORMAT}")
    for i, key in enumerate(keys):
        # a bearer token is visible ASCII without spaces (RFC 6750); anything else could never be sent
        if not all(33 <= ord(c) <= 126 for c in key) or len(key) < 8:
            raise ConfigurationError(
                f"{where}: key {i + 1} has {len(key)} characters or some that are not visible "
                "ASCII; a key is at least 8 visible ASCII characters without spaces (e.g. "
                "python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
    return tuple(dict.fromkeys(keys))
