"""The server process's start-up rules: the service module's import-time work (``setup_server``), exit status 3
when a model cannot load (signalled from the worker to the server that spawned it), its own Prometheus folder,
quiet 4xx logs, and the start-up heap frozen out of the GC.

Each is a rule BentoML 1.4.40 has otherwise, named with the function that changes it: a worker that cannot start
is respawned forever, or the server exits 0 (``report_failed_start``); a bad setting is a traceback and status 1
(``settings_or_exit``); every ``bentoml serve`` empties one shared Prometheus folder (``prepare_server_process``);
every 4xx is logged with a traceback (``QuietClientErrors``); every request is traced with no exporter to send to
(``untraced_without_exporter``); and it has no worker-start count or heap freeze to configure."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from capserve.errors import ConfigurationError
from capserve.serving.guard import QuietClientErrors
from capserve.serving.routes import FILE_FIELDS, LIST_FIELDS, route_parameters, unavailable_routes
from capserve.serving.runtimes import fastest_runtime, workers_environment
from capserve.serving.settings import Settings, bento_environment
from capserve.serving.tuned import apply_tuned
from capserve.serving.workers import Worker, assign, current_index, worker_count

__all__ = [
    "FAILED_START_EXIT_CODE",
    "FAILED_START_SIGNAL",
    "SERVER_PID_VARIABLE",
    "ServerSetup",
    "count_worker_start",
    "freeze_startup_heap",
    "leave_failed_worker",
    "prepare_server_process",
    "report_failed_start",
    "settings_or_exit",
    "setup_server",
    "untraced_without_exporter",
    "workers_or_exit",
]

# ---------------------------------------------------------------------------- the server process

FAILED_START_SIGNAL = signal.SIGUSR2  # worker → server process: the model could not be loaded


FAILED_START_EXIT_CODE = 3


SERVER_PID_VARIABLE = "CAPSERVE_SERVER_PID"  # set by the server process for its workers: whom to signal


_failed_start = threading.Event()


@dataclass(frozen=True)
class ServerSetup:
    """What the service module reads once, at import (``setup_server``): its settings and its number of workers.

    ``input_shapes`` is the (C, H, W) of each pixel-tensor route's model, for ``RequestGuard`` (the same mapping,
    ``guard_options``): the service's ``__init__`` fills it from ``Capsules.input_shapes``. BentoML takes the
    middleware's options at import and builds it before it creates the service instance, so the guard cannot be
    handed the instance itself."""

    settings: Settings
    workers: int
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def batchable(self) -> dict[str, Any]:
        """The ``@bentoml.api`` arguments of the batchable APIs (``/logits``, ``/multilabel_logits``).

        BentoML 1.4.40 refuses ``max_batch_size`` 1 for a batchable API (``_bentoml_sdk.method.APIMethod``'s
        validator ``gt(1)``), which is how ``CAPSERVE_MAX_BATCH_SIZE=1`` turns batching off: 2 is passed instead.
        Fixed upstream when that validator takes 1."""
        settings = self.settings
        return dict(
            batchable=True, max_batch_size=max(settings.max_batch_size, 2), max_latency_ms=settings.max_latency_ms
        )

    def worker(self) -> Worker:
        """This server process's share of the machine (its GPU or cores), for the service's ``__init__``."""
        return assign(self.settings, current_index(), self.workers)

    def guard_options(self, apis: Mapping[str, Any]) -> dict[str, Any]:
        """``RequestGuard``'s options for a service with these BentoML ``apis`` (``Service.apis``)."""
        settings = self.settings
        return dict(
            max_bytes=settings.max_bytes,
            file_fields=FILE_FIELDS,
            get_routes=("/model",),
            unavailable=unavailable_routes(settings),
            list_fields=LIST_FIELDS,
            parameters=route_parameters(apis),
            api_keys=settings.api_keys,
            input_shapes=self.input_shapes,
        )


_WORKER_STARTS: list[Any] = []  # the Prometheus counter, created on first use


def count_worker_start() -> None:
    """Count this worker's start in ``capserve_worker_starts_total{worker}``. BentoML's process manager starts a
    worker again when it dies, and a killed process's counts stay in the shared metrics folder: a worker whose count
    is above 1 has died and come back."""
    if not _WORKER_STARTS:
        import bentoml

        _WORKER_STARTS.append(
            bentoml.metrics.Counter(
                name="capserve_worker_starts",
                documentation="worker processes started, by worker index; above 1, that worker died and was restarted",
                labelnames=["worker"],
            )
        )
    _WORKER_STARTS[0].labels(worker=str(current_index())).inc()


def setup_server(module_file: str) -> ServerSetup:
    """The service module's import-time work, all of it, in the ``bentoml serve`` process and in each worker:
    ``prepare_server_process``, then the settings (a built bento's ``envs`` as defaults that the environment
    overrides, ``bento_environment``) and the number of workers. A bad setting stops the server with one line and
    exit status 3. ``module_file``: the service module's ``__file__``."""
    prepare_server_process()
    settings = settings_or_exit({**bento_environment(module_file), **os.environ})
    return ServerSetup(settings, workers_or_exit(settings))


def prepare_server_process() -> None:
    """Run at the service module's import (``setup_server``), in the ``bentoml serve`` process and in its worker.

    - A worker that cannot load its model signals the server process, which stops and exits with status 3.
      BentoML 1.4.40's process manager (circus) respawns the worker forever, or the server stops with status 0:
      orchestrators would see success. Fixed upstream when ``CAPSERVE_EXIT_ON_FAILURE=0 bentoml serve`` of a
      missing model exits non-zero by itself.
    - Each server gets its own Prometheus folder: BentoML 1.4.40's default is one folder under BENTOML_HOME that
      every ``bentoml serve`` empties at start (``bentoml.serving.ensure_prometheus_dir``), resetting the
      ``/metrics`` of servers already running. Fixed upstream when that folder is per server (tests/serving's
      ``test_a_second_server_keeps_the_first_ones_metrics_and_answers_501_and_503`` then passes without this).
    - BentoML's ERROR-with-traceback for client errors is dropped (``QuietClientErrors``).
    - Without a tracing exporter, requests skip OpenTelemetry (``untraced_without_exporter``).
    """
    logging.getLogger("bentoml._internal.server.http_app").addFilter(QuietClientErrors())
    capserve_log = logging.getLogger("capserve")
    if capserve_log.level == logging.NOTSET:  # BentoML's root logger shows warnings only: capserve says its choices
        capserve_log.setLevel(logging.INFO)
    untraced_without_exporter()
    if threading.current_thread() is not threading.main_thread():
        return  # imported by a test or a tool, not by a server: signal handlers are the main thread's
    signal.signal(FAILED_START_SIGNAL, _on_failed_start)
    atexit.register(_exit_status)
    os.environ.setdefault(SERVER_PID_VARIABLE, str(os.getpid()))  # the server process: its workers inherit it
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:  # the server process (its workers inherit the variable)
        try:
            from bentoml._internal.configuration.containers import BentoMLContainer
        except ImportError:
            return
        folder = tempfile.mkdtemp(prefix="capserve-metrics-")
        BentoMLContainer.prometheus_multiproc_dir.set(folder)
        atexit.register(shutil.rmtree, folder, True)


def freeze_startup_heap() -> None:
    """Exempt every object the server process holds once it has started (libraries, models, warm-up) from Python's
    cyclic garbage collector (``gc.freeze``). Its full collections otherwise walk those long-lived objects over and
    over under load, a share of the event loop's CPU per request (docs/benchmarks/serving.md, "HTTP request path").
    Called by the service once its models are loaded; requests' own objects are still collected."""
    gc.collect()
    gc.freeze()


def untraced_without_exporter() -> bool:
    """When BentoML's configuration names no tracing exporter (``tracing.exporter_type``) and no
    ``tracing.excluded_urls``, exclude every URL from its OpenTelemetry middleware: True when it did.

    BentoML 1.4.40 runs every request through that middleware (a server span, and a span per receive and per send;
    ``ServiceAppFactory.middlewares`` in ``_bentoml_impl.server.app``) even when no exporter is configured and
    nothing can be recorded, a large share of the event loop's work per image request (docs/benchmarks/serving.md).
    Fixed upstream when that property adds the middleware only with an exporter. With an exporter configured, requests
    are traced.
    """
    try:
        from bentoml._internal.configuration.containers import BentoMLContainer
        from opentelemetry.util.http import ExcludeList
    except ImportError:
        return False
    tracing = BentoMLContainer.config.tracing
    if tracing.exporter_type.get() is not None or tracing.excluded_urls.get() is not None:
        return False
    BentoMLContainer.tracing_excluded_urls.set(ExcludeList([".*"]))  # a regex searched in each request's URL
    return True


def settings_or_exit(env: Mapping[str, str] | None = None) -> Settings:
    """``Settings.from_env()`` with the tuned file's choices (``apply_tuned``), else the runtime measured fastest
    here (``fastest_runtime``: in the ``bentoml serve`` process, which hands it to the workers it starts next), for
    the service module's import: a bad setting stops the server with one line and exit status 3, as a model that
    cannot load does, where BentoML 1.4.40 turns an exception at the service's import into a traceback and status
    1. To tell when upstream says it in one line: let the error raise and run tests/serving/test_service.py's
    ``test_bad_setting_fails_startup_without_a_traceback``."""
    env = os.environ if env is None else env
    try:
        settings = fastest_runtime(apply_tuned(Settings.from_env(env), env), env)
    except ConfigurationError as e:
        print(f"capserve cannot start: {e}", file=sys.stderr, flush=True)
        raise SystemExit(FAILED_START_EXIT_CODE) from None
    os.environ.update(workers_environment(settings))  # the workers, started after this, serve what was measured
    return settings


def workers_or_exit(settings: Settings) -> int:
    """``worker_count(settings)`` for the service module's import: ``CAPSERVE_WORKERS=auto`` on ``cuda`` with no GPU
    visible stops the server with one line and exit status 3, as a bad setting does."""
    try:
        return worker_count(settings)
    except ConfigurationError as e:
        print(f"capserve cannot start: {e}", file=sys.stderr, flush=True)
        raise SystemExit(FAILED_START_EXIT_CODE) from None


def _on_failed_start(signum: int, frame: Any) -> None:
    _failed_start.set()
    os.kill(os.getpid(), signal.SIGTERM)  # BentoML's (circus's) graceful stop; the exit status is set at exit


def _exit_status() -> None:
    if _failed_start.is_set():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(FAILED_START_EXIT_CODE)


def report_failed_start() -> bool:
    """Called by a worker whose model cannot be loaded: stop the server process with a non-zero status; True when
    it did.

    Only a worker of a server that ``prepare_server_process`` set up signals, and only that server: ``Capsules``
    used in-process (a script, a test) must never signal whatever process happens to be its parent."""
    server = os.environ.get(SERVER_PID_VARIABLE)
    if os.environ.get("CAPSERVE_EXIT_ON_FAILURE", "1") != "0" and server == str(os.getppid()):
        os.kill(os.getppid(), FAILED_START_SIGNAL)
        return True
    return False


def leave_failed_worker() -> None:
    """End a worker whose server ``report_failed_start`` signalled, with the logs flushed and nothing more said.

    BentoML 1.4.40 logs an exception raised in the service's ``__init__`` (``ServiceAppFactory.create_instance``,
    run in the ASGI lifespan) with two tracebacks, after ``Capsules`` has said it in one line; fixed upstream when
    such a start with ``CAPSERVE_EXIT_ON_FAILURE=0`` logs at most one."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(FAILED_START_EXIT_CODE)
