"""SHA-256 digests, the one copy: what exported artifacts record about the weights and files they came from."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file, read in 1 MiB blocks (a checkpoint's weights, an ONNX file, an engine)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    """SHA-256 of bytes in memory."""
    return hashlib.sha256(data).hexdigest()
