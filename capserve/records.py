"""JSON objects read into dataclasses (configs, model metadata, engine sidecars, INT8 summaries): only the fields
the dataclass declares, every required one present; nothing in a file is evaluated or set blindly."""

from __future__ import annotations

import dataclasses
from typing import Any


def checked_fields(cls: type, data: Any, what: str) -> dict[str, Any]:
    """``data`` when it is a JSON object whose keys are fields of dataclass ``cls``, the required ones all there;
    else ``ValueError`` naming ``what`` (e.g. "model metadata") and the keys at fault."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(data).__name__}")
    fields = dataclasses.fields(cls)
    known = {f.name for f in fields}
    if unknown := sorted(set(data) - known):
        raise ValueError(f"unknown {what} keys {unknown}; known keys: {sorted(known)}")
    required = {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if missing := sorted(required - data.keys()):
        raise ValueError(f"{what} lacks {missing}")
    return data
