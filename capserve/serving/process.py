"""The server process's start-up rules: exit status 3 when a model cannot load (signalled from the worker to the
server that spawned it), its own Prometheus folder, quiet 4xx logs, and the start-up heap frozen out of the GC."""

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
from typing import Any

from capserve.errors import ConfigurationError
from capserve.serving.cores import CORES_FOLDER_VARIABLE
from capserve.serving.guard import QuietClientErrors
from capserve.serving.settings import Settings
from capserve.serving.workers import worker_count

# ---------------------------------------------------------------------------- the server process

FAILED_START_SIGNAL = signal.SIGUSR2  # worker → server process: the model could not be loaded


FAILED_START_EXIT_CODE = 3


SERVER_PID_VARIABLE = "CAPSERVE_SERVER_PID"  # set by the server process for its workers: whom to signal


_failed_start = threading.Event()


def prepare_server_process() -> None:
    """Run at the service module's import, in the ``bentoml serve`` process and in its worker.

    - A worker that cannot load its model signals the server process, which stops and exits with status 3
      (BentoML would respawn the worker forever, or stop with status 0: orchestrators would see success).
    - Each server gets a folder for its workers' core locks (capserve.serving.cores).
    - Each server gets its own Prometheus folder: BentoML's default is one folder under BENTOML_HOME that
      every ``bentoml serve`` empties at start, resetting the ``/metrics`` of servers already running.
    - BentoML's ERROR-with-traceback for client errors is dropped (each is logged as one line instead).
    - Without a tracing exporter, requests skip OpenTelemetry (``untraced_without_exporter``).
    """
    logging.getLogger("bentoml._internal.server.http_app").addFilter(QuietClientErrors())
    untraced_without_exporter()
    if threading.current_thread() is not threading.main_thread():
        return  # imported by a test or a tool, not by a server: signal handlers are the main thread's
    signal.signal(FAILED_START_SIGNAL, _on_failed_start)
    atexit.register(_exit_status)
    os.environ.setdefault(SERVER_PID_VARIABLE, str(os.getpid()))  # the server process: its workers inherit it
    if CORES_FOLDER_VARIABLE not in os.environ:  # the server process: its workers share the core locks in it
        cores = tempfile.mkdtemp(prefix="capserve-cores-")
        os.environ[CORES_FOLDER_VARIABLE] = cores
        atexit.register(shutil.rmtree, cores, True)
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
    over under load: 14 % of the event loop's CPU per ``/multilabel`` request (docs/benchmarks.md).
    Called by the service once its models are loaded; requests' own objects are collected as before."""
    gc.collect()
    gc.freeze()


def untraced_without_exporter() -> bool:
    """When BentoML's configuration names no tracing exporter (``tracing.exporter_type``) and no
    ``tracing.excluded_urls``, exclude every URL from its OpenTelemetry middleware: True when it did.

    BentoML runs every request through that middleware (a server span, and a span per receive and per send) even
    when no exporter is configured and nothing can be recorded; that was about 40 % of the event loop's work per
    image request (docs/benchmarks.md). With an exporter configured, requests are traced as before.
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
    """``Settings.from_env()`` for the service module's import: a bad setting stops the server with one line
    and exit status 3 (not a traceback and status 1), as a model that cannot load does."""
    try:
        return Settings.from_env(env)
    except ConfigurationError as e:
        print(f"capserve cannot start: {e}", file=sys.stderr, flush=True)
        raise SystemExit(FAILED_START_EXIT_CODE) from None


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
    """End a worker whose server ``report_failed_start`` signalled, with the logs flushed and nothing more said."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(FAILED_START_EXIT_CODE)
