"""Files and folders written whole: written beside their place under a hidden name, then renamed into it, so that a
process killed (or failing) half-way leaves what was there before, whole, and no reader ever opens half a file."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "CACHE_VARIABLE",
    "cache_file",
    "keep_cached",
    "partial_file",
    "read_cached",
    "recover_directory",
    "replacing_directory",
    "swap_names",
    "write_whole",
]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def partial_file(path: Path) -> Iterator[Path]:
    """A hidden sibling of ``path`` to write, renamed over ``path`` once written (removed if the writing fails)."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_whole(path: str | Path, data: str | bytes) -> None:
    """``data`` into ``path`` through ``partial_file``: a full disk or a kill half-way leaves the file that was there
    (or none), whole; never half of the new one."""
    with partial_file(Path(path)) as partial:
        if isinstance(data, bytes):
            partial.write_bytes(data)
        else:
            partial.write_text(data)


def swap_names(directory: Path) -> tuple[Path, Path]:
    """The hidden siblings ``replacing_directory`` uses: the folder being written, and the one being replaced."""
    return directory.with_name(f".{directory.name}.partial"), directory.with_name(f".{directory.name}.old")


@contextlib.contextmanager
def replacing_directory(directory: str | Path) -> Iterator[Path]:
    """A fresh hidden folder to write a model directory into; it takes ``directory``'s place only once written
    whole, so a process killed while writing leaves ``directory`` as it was. A directory cannot replace a non-empty
    one in one rename, so the swap is two (the old one aside, the new one in) and ``recover_directory`` finishes
    a swap a kill cut between them."""
    directory = Path(directory)
    partial, old = swap_names(directory)
    recover_directory(directory)
    shutil.rmtree(partial, ignore_errors=True)  # left by a process killed while writing
    partial.mkdir(parents=True)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if directory.exists():
        os.rename(directory, old)
    os.rename(partial, directory)
    shutil.rmtree(old, ignore_errors=True)


def recover_directory(directory: str | Path) -> None:
    """Finish a ``replacing_directory`` swap a kill interrupted: without ``directory``, the whole one set aside comes
    back; beside ``directory``, it is the finished swap's leftover and goes."""
    directory = Path(directory)
    _, old = swap_names(directory)
    if not old.exists():
        return
    if directory.exists():
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(old, directory)
        log.warning("%s: restored the checkpoint a killed run had set aside", directory)


# ------------------------------------------------------------------------------------------ measurements kept


CACHE_VARIABLE = "CAPSERVE_CACHE_DIR"  # where measurements of this machine are kept (``cache_file``)


def cache_file(name: str) -> Path:
    """The file ``name`` among the measurements kept for this machine (training's step times, the server's runtime
    speeds): in ``$CAPSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/capserve`` (by default ``~/.cache/capserve``)."""
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE]) / name
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "capserve" / name


def read_cached(path: Path) -> dict:
    """The JSON object in ``path``; {} when there is none, or it is unreadable or not an object (measured again)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def keep_cached(path: Path, data: dict, what: str) -> None:
    """Write ``data`` whole to ``path``; where it cannot be written (a read-only home), a warning that ``what``
    is measured again next time, never an error: the measurement was made and is used."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, json.dumps(data, indent=1) + "\n")
    except OSError as e:
        log.warning("cannot keep %s in %s (%s): measured again next time", what, path, e)
