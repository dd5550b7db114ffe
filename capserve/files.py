"""Files and folders written whole: written beside their place under a hidden name, then renamed into it, so that a
process killed (or failing) half-way leaves what was there before, whole, and no reader ever opens half a file."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = ["partial_file", "recover_directory", "replacing_directory", "swap_names", "write_whole"]

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
