"""The decoded images of a user's data, kept in one safetensors file per run folder (``build_cache``).

The file is keyed by a fingerprint of the files (path, size, mtime), labels, splits and input size: unchanged data is
never decoded twice, and any change decodes it again. A cache that cannot be read is ignored and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from capserve.data.own import SPLITS, FailureLog, InputSize, Manifest, decode_split
from capserve.data.splits import Split

__all__ = ["CACHE_FILE", "CACHE_FORMAT", "OwnData", "build_cache", "fingerprint"]

log = logging.getLogger(__name__)


CACHE_FILE = "data-cache.safetensors"


CACHE_FORMAT = 1  # bump when the cache layout or the preprocessing changes


def fingerprint(manifest: Manifest, labels: Sequence[str], spec: InputSize) -> str:
    """A hash of everything the cache depends on: files (path, size, mtime), labels, splits, input size."""
    h = hashlib.sha256()
    head = {
        "format": CACHE_FORMAT,
        "labels": list(labels),
        "task": manifest.task,
        "channels": spec.in_channels,
        "size": spec.image_size,
    }
    h.update(json.dumps(head).encode())
    for split in SPLITS:
        for s in manifest.splits.get(split, []):
            try:
                st = s.path.stat()
                stamp = f"{st.st_size}:{st.st_mtime_ns}"
            except OSError:
                stamp = "missing"
            h.update(f"\n{split}\t{s.path}\t{stamp}\t{json.dumps(s.labels)}".encode())  # "a b" ≠ ("a", "b")
    return h.hexdigest()


@dataclass
class OwnData:
    """Decoded splits of a user's data (``val``/``test`` None when absent) and how many files were skipped."""

    labels: tuple[str, ...]
    task: Literal["single_label", "multi_label"]
    splits: dict[str, Split]
    skipped: int
    from_cache: bool


def build_cache(manifest: Manifest, labels: Sequence[str], spec: InputSize, cache: Path | None) -> OwnData:
    """Decode every split once (or read ``cache`` when its fingerprint matches) into uint8 tensors."""
    key = fingerprint(manifest, labels, spec)
    multi = manifest.task == "multi_label"
    names = [s for s in SPLITS if manifest.splits.get(s)]
    if cache is not None and cache.is_file():
        try:
            with safe_open(str(cache), "pt") as f:
                meta = f.metadata() or {}
                if meta.get("fingerprint") == key:
                    splits = {s: Split(f.get_tensor(f"{s}.images"), f.get_tensor(f"{s}.targets")) for s in names}
                    log.info(
                        "decoded images reused from %s (%s)",
                        cache,
                        ", ".join(f"{s} {len(v)}" for s, v in splits.items()),
                    )
                    return OwnData(tuple(labels), manifest.task, splits, int(meta.get("skipped", 0)), True)
            log.info("data changed since %s was built: decoding again", cache)
        except (SafetensorError, OSError, KeyError, AssertionError) as e:
            log.warning("ignoring unreadable cache %s (%s): decoding again", cache, e)
    failures = FailureLog(sum(len(manifest.splits[s]) for s in names), manifest.source)
    splits = {s: decode_split(manifest.splits[s], labels, multi, spec, failures, f"decoding {s}") for s in names}
    failures.check()
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tensors = {f"{s}.{k}": getattr(v, k).contiguous() for s, v in splits.items() for k in ("images", "targets")}
        tmp = cache.with_name(cache.name + ".tmp")
        save_file(
            tensors,
            str(tmp),
            metadata={"fingerprint": key, "skipped": str(len(failures.failures)), "source": str(manifest.source)},
        )
        tmp.replace(cache)
    return OwnData(tuple(labels), manifest.task, splits, len(failures.failures), False)
