"""An export that fails (or is killed) half-way never leaves a partial ``model.onnx`` where a server would load it."""

from __future__ import annotations

import pytest

pytest.importorskip("onnx")

import onnx
from support.models import tiny_model

from capserve.export.onnx import export_onnx


def test_a_failed_export_keeps_the_file_that_was_there_and_leaves_no_partial(tmp_path, monkeypatch):
    model = tiny_model("cifar10-simple")
    path = export_onnx(model, tmp_path / "model.onnx")
    before = path.read_bytes()
    real_save = onnx.save_model

    def dies_half_way(proto, target, **kw):  # a kill or a full disk while the bytes go out
        real_save(proto, target, **kw)
        with open(target, "r+b") as f:
            f.truncate(100)
        raise OSError("No space left on device")

    monkeypatch.setattr(onnx, "save_model", dies_half_way)
    with pytest.raises(OSError, match="No space left"):
        export_onnx(model, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"]
    monkeypatch.setattr(onnx, "save_model", real_save)
    onnx.checker.check_model(str(path))
