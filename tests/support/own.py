"""Folders and CSVs of a user's own images for the tests: three labels that differ by colour, in every mode and
format the service decodes."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

# three labels that differ by colour, so a few steps learn them; names with a space and a non-ASCII letter
COLOURS = {"red fox": (230, 30, 30), "blue whale": (30, 40, 230), "grüne Wiese": (30, 210, 40)}
LABELS = tuple(sorted(COLOURS))
SIZE = 16  # the models' input side in these tests
MODES = ("RGB", "L", "RGBA", "P")


def picture(label: str, seed: int, side: int = 20, mode: str = "RGB", fmt: str = "PNG") -> bytes:
    """A noisy picture of ``label``'s colour, encoded in ``fmt`` from a ``mode`` image."""
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(COLOURS[label]) + rng.integers(-25, 26, (side, side + 4, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    if mode == "RGBA":
        alpha = np.full((side, side + 4), 255, np.uint8)
        alpha[:2] = 0  # a transparent band: composited over white, as the service does
        image.putalpha(Image.fromarray(alpha))
    elif mode == "P":
        image = image.quantize(16)
    elif mode != "RGB":
        image = image.convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def write_images(directory: Path, per_label: int, seed: int = 0) -> list[Path]:
    """``directory/<label>/`` with ``per_label`` images each, cycling formats and modes (one in a sub-folder)."""
    files = []
    for li, label in enumerate(LABELS):
        for i in range(per_label):
            mode = MODES[i % len(MODES)]
            fmt = "JPEG" if i % 3 == 1 and mode in ("RGB", "L") else "PNG"
            sub = directory / label / ("nested" if i == 0 else "")
            sub.mkdir(parents=True, exist_ok=True)
            path = sub / f"{i:03d}.{fmt.lower().replace('jpeg', 'jpg')}"
            path.write_bytes(picture(label, seed * 1000 + li * 100 + i, mode=mode, fmt=fmt))
            files.append(path)
    return files


def write_folder(root: Path, train: int = 12, val: int = 0, test: int = 0) -> Path:
    """``root/<label>/...`` (no val/test) or ``root/train|val|test/<label>/...``."""
    if not val and not test:
        write_images(root, train)
    else:
        for split, n, seed in (("train", train, 0), ("val", val, 1), ("test", test, 2)):
            if n:
                write_images(root / split, n, seed)
    (root / LABELS[0] / "notes.txt" if not (val or test) else root / "train" / LABELS[0] / "notes.txt").write_text("x")
    return root


def write_csv(root: Path, rows: list[tuple[str, str, str]], header: str = "image,labels,split") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    lines = [header, *(",".join(r) for r in rows)]
    path = root / "data.csv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
