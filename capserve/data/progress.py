"""The one progress bar (tqdm) of training, evaluation and prediction, with log records on lines of their own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


@contextlib.contextmanager
def progress_bar(total: int | None, desc: str, unit: str = "img", **options: Any) -> Iterator[tqdm]:
    """A tqdm bar over ``total`` items (None: a count without an end). Log records (a warning from the model, say)
    print on lines of their own above it, instead of at the end of the bar's line. ``options`` go to tqdm
    (``initial``, ``disable``, ``leave``)."""
    options = {"mininterval": 0.5, "leave": True, "dynamic_ncols": True, **options}
    with logging_redirect_tqdm(), tqdm(total=total, desc=desc, unit=unit, **options) as bar:
        yield bar
