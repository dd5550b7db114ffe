"""The tuned file: the serving choices ``capserve tune`` measured best on one machine, and how a server reads them.

A server's settings come, for each choice, from the first of: an explicit ``CAPSERVE_*`` variable; the tuned file,
when it was measured on this same CPU (model, architecture, features, usable cores) and device; the defaults. The
file is ``tuned.json`` in the single-label model's folder (``CAPSERVE_MODEL``; it travels into BentoML's model store
and so into a bento), or the file ``CAPSERVE_TUNED`` names (``none``: no file). A file measured on another CPU is
ignored with one log line: its choices were never measured here. ``Settings.sources`` says where each choice came
from, and ``GET /model`` reports it (``choices``).

BentoML 1.4.40 has no such file: its configuration is taken as given, never measured or tied to a CPU.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capserve.errors import ConfigurationError
from capserve.files import partial_file
from capserve.hardware import CpuInfo, cpu_info
from capserve.pipeline.models import resolve_model
from capserve.records import checked_fields
from capserve.runtime import BACKENDS
from capserve.runtime.precision import PRECISIONS
from capserve.serving.settings import Settings

__all__ = [
    "CHOICES",
    "TUNED_FILE",
    "TUNED_VARIABLE",
    "Tuned",
    "apply_tuned",
    "read_tuned",
    "tuned_path",
    "write_tuned",
]

log = logging.getLogger(__name__)

TUNED_FILE = "tuned.json"


TUNED_VARIABLE = "CAPSERVE_TUNED"  # a tuned file to read instead of MODEL/tuned.json; "none": none


# the settings a tuned file may choose, with their types; ``artifact`` is the graph file in the model folder that the
# onnxruntime backend serves (an INT8 graph, when tune measured it best)
CHOICES: dict[str, type] = {
    "backend": str,
    "precision": str,
    "artifact": str,
    "workers": int,
    "threads": int,
    "max_batch_size": int,
}


# chosen together or not at all: a runtime measured as a whole (an explicit CAPSERVE_BACKEND or CAPSERVE_PRECISION
# keeps the defaults' runtime rather than half of the tuned one)
RUNTIME_CHOICES = ("backend", "precision", "artifact")
# likewise the split of the cores: threads measured for the tuned number of workers oversubscribe the CPU under
# another number (an explicit CAPSERVE_WORKERS or CAPSERVE_THREADS keeps the defaults' split)
CORE_CHOICES = ("workers", "threads")


@dataclass(frozen=True)
class Tuned:
    """What ``capserve tune`` wrote: the CPU and device it measured on, the chosen settings and every measurement.

    ``cpu`` is ``CpuInfo.to_dict()`` plus ``cores``; ``measured`` a list of rows (settings, requests/s at 32
    clients, p50 at 1 client, errors) for the record, not read by the server."""

    cpu: dict[str, Any]
    device: str
    settings: dict[str, Any]
    measured: list[dict[str, Any]] = field(default_factory=list)
    budget_s: float = 0.0
    capserve_version: str = ""

    def __post_init__(self) -> None:
        for name, value in self.settings.items():
            kind = CHOICES.get(name)
            if kind is None:
                raise ValueError(f"tuned settings: unknown choice {name!r}; known: {sorted(CHOICES)}")
            if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 1):
                raise ValueError(f"tuned settings: {name}={value!r} is not a {kind.__name__} (ints >= 1)")
        if self.settings.get("backend", "onnxruntime") not in BACKENDS:
            raise ValueError(f"tuned settings: backend {self.settings['backend']!r} is not one of {BACKENDS}")
        if self.settings.get("precision", "auto") not in PRECISIONS:
            raise ValueError(f"tuned settings: precision {self.settings['precision']!r} is not one of {PRECISIONS}")
        for key in ("model", "architecture", "features", "cores"):
            if key not in self.cpu:
                raise ValueError(f"tuned file: its cpu lacks {key!r}")
        c = self.cpu
        if not isinstance(c["features"], list) or not isinstance(c["cores"], int) or isinstance(c["cores"], bool):
            raise ValueError("tuned file: its cpu's features must be a list and its cores an integer")

    def measured_on(self) -> CpuInfo:
        """The CPU this file was measured on."""
        c = self.cpu
        return CpuInfo(str(c["model"]), str(c["architecture"]), int(c["cores"]), frozenset(c["features"]))

    def mismatch(self, cpu: CpuInfo, device: str) -> str | None:
        """Why this file does not apply on ``cpu`` serving on ``device``; None when it does."""
        there = self.measured_on()
        if there != cpu:
            return f"it was measured on {there.describe()}, this machine is {cpu.describe()}"
        if self.device != device:
            return f"it was measured on device {self.device}, this server runs on {device}"
        return None


def tuned_path(settings: Settings, env: Mapping[str, str]) -> Path | None:
    """The tuned file a server with ``settings`` reads: ``CAPSERVE_TUNED`` (None for ``none``), else
    ``tuned.json`` in the single-label model's folder (beside the file, for a model given as a file)."""
    named = env.get(TUNED_VARIABLE, "").strip()
    if named.lower() == "none":
        return None
    if named:
        return Path(named).expanduser()
    folder = resolve_model(settings.model).path
    return (folder if folder.is_dir() else folder.parent) / TUNED_FILE


def read_tuned(path: Path) -> Tuned:
    """The tuned file at ``path``, checked (unknown or missing keys, choices of the wrong type: ``ValueError``)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the tuned file {path}: {e}") from None
    return Tuned(**checked_fields(Tuned, data, f"tuned file {path}"))


def write_tuned(tuned: Tuned, path: Path) -> None:
    """Write ``tuned`` to ``path`` whole (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with partial_file(path) as partial:
        partial.write_text(json.dumps(dataclasses.asdict(tuned), indent=2) + "\n")


def _explicit(name: str, env: Mapping[str, str]) -> bool:
    """Whether the environment chose ``name`` itself (``auto`` leaves the choice to capserve)."""
    if name == "artifact":
        return False
    value = env.get(f"CAPSERVE_{name.upper()}", "").strip().lower()
    return bool(value) and value != "auto"


def apply_tuned(settings: Settings, env: Mapping[str, str], cpu: CpuInfo | None = None) -> Settings:
    """``settings`` (read from ``env``) with each choice the environment left open taken from the tuned file, when
    there is one measured on this CPU and device; ``sources`` says where each choice came from. A file measured
    elsewhere is ignored with a log line; an unreadable one stops the server (``ConfigurationError``)."""
    sources = {name: (f"CAPSERVE_{name.upper()}" if _explicit(name, env) else "default") for name in CHOICES}
    path = tuned_path(settings, env)
    if path is None or not path.is_file():
        if env.get(TUNED_VARIABLE, "").strip() and path is not None:
            raise ConfigurationError(f"{TUNED_VARIABLE}={path}: no such file (write one with `capserve tune MODEL`)")
        return dataclasses.replace(settings, sources=sources)
    try:
        tuned = read_tuned(path)
    except ValueError as e:
        raise ConfigurationError(f"{e}; run `capserve tune` again, or set {TUNED_VARIABLE}=none") from None
    why = tuned.mismatch(cpu or cpu_info(), settings.device)
    if why:
        log.warning("ignoring the tuned file %s: %s (run `capserve tune` on this machine)", path, why)
        return dataclasses.replace(settings, sources=sources)
    chosen = dict(tuned.settings)
    for group in (RUNTIME_CHOICES, CORE_CHOICES):
        if any(_explicit(name, env) for name in group):
            chosen = {k: v for k, v in chosen.items() if k not in group}
    # GET /model shows it: the file's name, no host path
    source = f"tuned ({path.name}, {tuned.measured_on().describe()})"
    changes = {k: v for k, v in chosen.items() if not _explicit(k, env)}
    sources.update({k: source for k in changes})
    if changes.keys() & set(RUNTIME_CHOICES):  # the runtime taken whole: its default graph file is the tuned one too
        sources.update({k: source for k in RUNTIME_CHOICES})
    log.info("tuned settings from %s: %s", path, ", ".join(f"{k}={v}" for k, v in sorted(changes.items())) or "none")
    return dataclasses.replace(settings, **changes, sources=sources)
