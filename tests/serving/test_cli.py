"""``capserve serve`` (checked in-process up to the command it runs; the real server from the installed wheel is
tests/test_wheel.py's), the top-level ``capserve`` help and usage, and model sources given as files."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
from support.models import tiny_model
from support.server import export

from capserve.cli import main
from capserve.pipeline.models import open_model
from capserve.serving.cli import SERVICE, server_environment
from capserve.serving.settings import Settings

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return export(tiny_model("cifar10-resnet"), tmp_path_factory.mktemp("m") / "cifar10", explain=True)


def test_serve_runs_the_packaged_service_with_the_model(model_dir, capsys, monkeypatch):
    monkeypatch.delenv("CAPSERVE_MODEL", raising=False)
    assert main(["serve", str(model_dir), "--port", "3999", "--dry-run"]) == 0
    command = capsys.readouterr().out.split()
    assert command[1:5] == ["-m", "bentoml", "serve", SERVICE] and SERVICE == "capserve.serving.service:CapsuleService"
    assert command[command.index("--port") + 1] == "3999"


def test_serve_sets_the_model_and_no_default_multilabel_model():
    args = argparse.Namespace(model="runs/x/best", multilabel_model=None)
    env = server_environment(args, {"PATH": "/bin"})
    assert env["CAPSERVE_MODEL"] == "runs/x/best" and env["CAPSERVE_MULTILABEL_MODEL"] == "none"
    assert server_environment(args, {"CAPSERVE_MULTILABEL_MODEL": "m"})["CAPSERVE_MULTILABEL_MODEL"] == "m"
    both = argparse.Namespace(model="a", multilabel_model="b")
    assert server_environment(both, {"CAPSERVE_MULTILABEL_MODEL": "m"})["CAPSERVE_MULTILABEL_MODEL"] == "b"
    assert "CAPSERVE_MODEL" not in server_environment(argparse.Namespace(model=None, multilabel_model=None), {})


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["serve", "runs/nosuch"], {}, "MODEL 'runs/nosuch' is not a file, a folder"),
        (["serve", "MODEL", "--multilabel-model", "nope"], {}, "--multilabel-model none"),
        (["serve", "MODEL"], {"CAPSERVE_MAX_BATCH_SIZE": "lots"}, "CAPSERVE_MAX_BATCH_SIZE='lots' is not an integer"),
        (["serve", "MODEL", "--port", "70000"], {}, "--port must be in 1..65535"),
    ],
)
def test_serve_refuses_in_one_line_before_starting(model_dir, capsys, monkeypatch, argv, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = [str(model_dir) if a == "MODEL" else a for a in argv]
    assert main([*argv, "--dry-run"]) == 2
    out = capsys.readouterr()
    assert not out.out and out.err.count("\n") == 1 and message in out.err, out.err


def test_help_says_what_the_tool_does(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "capsule networks" in text and "serve" in text and "add_arguments" not in text


def test_a_misspelt_flag_shows_the_commands_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--epocs", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: capserve train") and "--epochs" in err
    assert "unrecognized arguments: --epocs 2" in err


def test_a_model_given_as_an_onnx_file_serves_with_its_explanation_graph(model_dir):
    runtime, explainer, source = open_model(str(model_dir / "model.onnx"), Settings())
    assert source.path == model_dir / "model.onnx" and runtime.metadata.task == "single_label"
    assert explainer is not None and explainer.explainable
    with pytest.raises(ValueError, match="cannot serve"):
        open_model(str(model_dir / "model.onnx"), Settings(backend="tensorrt"))


def test_the_multilabel_model_does_not_announce_explain_is_off(tmp_path, caplog):
    """/explain uses the single-label model only: a multi-label model without an explanation graph said "/explain
    is off" at every start."""
    bare = export(tiny_model("multimnist-matrix-small"), tmp_path / "multi", explain=False)
    with caplog.at_level(logging.WARNING):
        _, explainer, _ = open_model(str(bare), Settings(), explain=False)
    assert explainer is None and "/explain is off" not in caplog.text
    with caplog.at_level(logging.WARNING):
        open_model(str(bare), Settings())  # as the single-label model it would be: said
    assert "/explain is off" in caplog.text
