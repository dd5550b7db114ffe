"""``capserve predict``'s SOURCE arguments → image paths, in the order given, one at a time (a folder of a million
files is never listed whole in memory; a glob is, sorted, as the shell would)."""

from __future__ import annotations

import csv
import glob
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

from capserve.data.images import IMAGE_SUFFIXES
from capserve.errors import UsageError

GLOB_CHARACTERS = frozenset("*?[")


def _folder(root: Path) -> Iterator[str]:
    """Every image below ``root`` (the suffixes training reads, hidden files and folders skipped), sorted per
    folder, depth first."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith(".") and Path(name).suffix.lower() in IMAGE_SUFFIXES:
                yield str(Path(folder) / name)


def _manifest(path: Path) -> Iterator[str]:
    """A CSV's ``image`` column, relative paths taken from the CSV's folder (as ``capserve train`` reads them)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "image" not in reader.fieldnames:
            raise UsageError(f"{path}: a CSV source needs an 'image' column (found {reader.fieldnames})")
        for row in reader:
            image = (row["image"] or "").strip()
            if image:
                yield image if Path(image).is_absolute() else str(path.parent / image)


def expand(sources: Iterable[str], stdin: TextIO | None = None) -> Iterator[str]:
    """Image paths from files, folders (recursive), globs, CSV manifests (their ``image`` column) and ``-`` (one path
    per line on ``stdin``), in the order given. A source that names nothing raises ``UsageError``; a named file
    that is not an image still comes out (its record says why it could not be read)."""
    for source in sources:
        if source == "-":
            for line in stdin or sys.stdin:
                if line.strip():
                    yield line.strip()
            continue
        path = Path(source)
        if path.is_dir():
            yield from _folder(path)
        elif path.suffix.lower() == ".csv" and path.is_file():
            yield from _manifest(path)
        elif path.exists():
            yield source
        elif GLOB_CHARACTERS & set(source):
            matches = sorted(glob.glob(source, recursive=True))
            if not matches:
                raise UsageError(f"{source!r} matches no file")
            for match in matches:
                yield from _folder(Path(match)) if Path(match).is_dir() else iter([match])
        else:
            raise UsageError(f"{source!r} is not a file, a folder, a glob that matches or '-' (paths on stdin)")
