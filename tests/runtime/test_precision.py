"""Serving precision: CAPSERVE_PRECISION parsing and refusals, native-bf16 detection, the bf16-vs-fp32 agreement check
and its fp32 fallback (in-process, through the service's own model loading), `capserve verify --precision bf16`, and
one real `bentoml serve` at bf16."""

from __future__ import annotations

import logging
import re
import types
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from support.models import tiny_model
from support.server import failed_start, random_png, start_server, stop, wait_ready

from capserve.cli import main
from capserve.data.images import preprocess
from capserve.errors import ConfigurationError
from capserve.pipeline.models import open_model
from capserve.runtime import load_runtime
from capserve.runtime import precision as P
from capserve.runtime.metadata import ModelMetadata
from capserve.serving.settings import Settings

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "cifar10"  # has model.onnx and model-explain.onnx

# ------------------------------------------------------------------------------------------ models


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random-weight models, and a contrived one whose bf16 answers cannot agree with fp32."""
    tmp = tmp_path_factory.mktemp("precision")
    tiny_model("cifar10-resnet").save(tmp / "cifar10")
    tiny_model("multimnist-matrix-small", thresholds=(0.3, 0.7) * 5).save(tmp / "multimnist")
    # Every logit sits on an offset of 1000, where bf16's spacing is 4: the classes' differences (~0.01) vanish,
    # bf16 ties every class and picks class 0, fp32 still ranks them. The way bf16 breaks a real model (a large
    # shared term swamping small differences), made certain.
    contrived = tiny_model("cifar10-resnet")
    with torch.no_grad():
        contrived.classifier.bias.fill_(1000.0)
        contrived.classifier.weight.mul_(0.05)
    contrived.save(tmp / "contrived")
    return {"cifar10": tmp / "cifar10", "multimnist": tmp / "multimnist", "contrived": tmp / "contrived"}


# ------------------------------------------------------------------------------------------ settings


def test_precision_setting_parses_and_defaults_to_auto():
    assert Settings.from_env({}).precision == "auto"
    assert Settings.from_env({}).bf16_min_agreement == P.BF16_MIN_AGREEMENT
    s = Settings.from_env(
        {"CAPSERVE_BACKEND": "torch", "CAPSERVE_PRECISION": " BF16 ", "CAPSERVE_BF16_MIN_AGREEMENT": "0.75"}
    )
    assert (s.backend, s.precision, s.bf16_min_agreement) == ("torch", "bf16", 0.75)
    for precision in ("fp32", "auto"):  # every backend serves these
        for backend in ("onnxruntime", "torch", "tensorrt"):
            s = Settings.from_env({"CAPSERVE_BACKEND": backend, "CAPSERVE_PRECISION": precision})
            assert s.precision == precision


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CAPSERVE_PRECISION": "bf16"}, "CAPSERVE_PRECISION=bf16 works with the torch backend only"),
        ({"CAPSERVE_PRECISION": "bf16", "CAPSERVE_BACKEND": "tensorrt"}, "CAPSERVE_BACKEND=torch"),
        ({"CAPSERVE_PRECISION": "fp16", "CAPSERVE_BACKEND": "torch"}, "choose one of: fp32, bf16, auto"),
        ({"CAPSERVE_BF16_MIN_AGREEMENT": "most"}, "is not a number"),
        ({"CAPSERVE_BF16_MIN_AGREEMENT": "1.5"}, "must be in [0, 1]"),
    ],
)
def test_precision_setting_refusals(env, message):
    with pytest.raises(ConfigurationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Settings.from_env(env)


def test_bf16_with_onnxruntime_stops_the_real_server(tmp_path):
    log = failed_start(tmp_path, CAPSERVE_PRECISION="bf16", CAPSERVE_BACKEND="onnxruntime")
    assert "CAPSERVE_PRECISION=bf16 works with the torch backend only" in log


# ------------------------------------------------------------------------------------------ native bf16, auto


def capabilities(monkeypatch, caps: dict, onednn: bool = True) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: types.MappingProxyType(caps))
    monkeypatch.setattr(P, "_onednn_bf16", lambda: onednn)


@pytest.mark.parametrize(
    ("caps", "onednn", "native"),
    [
        ({"architecture": "x86_64", "avx512_f": True, "avx512_bf16": True}, True, True),
        ({"architecture": "x86_64", "avx512_f": True, "amx_bf16": True, "amx_tile": True}, True, True),
        # oneDNN runs bf16 on any AVX-512 core, emulated: not native, auto stays fp32
        ({"architecture": "x86_64", "avx512_f": True, "avx512_bw": True, "avx512_bf16": False}, True, False),
        ({"architecture": "x86_64", "avx2": True}, False, False),
        ({"architecture": "arm64", "neon": True, "bf16": True}, True, True),
        ({"architecture": "arm64", "neon": True, "sve": True}, False, False),
        ({"architecture": "arm64", "bf16": True}, False, False),  # the CPU has it, this torch's oneDNN cannot use it
    ],
)
def test_native_bf16_follows_what_torch_reports(monkeypatch, caps, onednn, native):
    capabilities(monkeypatch, caps, onednn)
    support = P.native_bf16()
    assert support.native is native and caps["architecture"] in support.reason
    assert P.resolve_precision("auto", "torch")[0] == ("bf16" if native else "fp32")


def kernel_cpu_flags() -> set[str] | None:
    """This CPU's features as the Linux kernel lists them (/proc/cpuinfo "flags" on x86, "Features" on Arm): a
    source independent of torch's cpuinfo, which ``native_bf16`` reads. None elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    found = re.search(r"^(?:flags|Features)\s*:(.*)$", text, re.MULTILINE)
    return set(found.group(1).split()) if found else None


def test_native_bf16_on_this_machine_agrees_with_the_kernels_cpu_flags():
    """What the kernel says the processor does, against what ``native_bf16`` concludes: x86 needs avx512_bf16 or
    amx_bf16 (plain avx512f emulates bf16), Arm the bf16 feature (``bf16``, ``svebf16``). A torch whose oneDNN cannot
    use it reports not native, with the reason."""
    flags = kernel_cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo feature list on this machine")
    support = P.native_bf16()
    hardware = bool(flags & {"avx512_bf16", "amx_bf16", "bf16", "svebf16"})
    if not hardware:
        assert not support.native and "without bf16 instructions" in support.reason, support
    elif torch.backends.mkldnn.is_available():
        assert support.native, support
        assert any(f in support.reason for f in ("avx512_bf16", "amx_bf16", "bf16")), support
    else:
        assert not support.native and "oneDNN" in support.reason, support
    assert P.resolve_precision("auto", "torch")[0] == ("bf16" if support.native else "fp32")


def test_resolve_precision(monkeypatch, caplog):
    capabilities(monkeypatch, {"architecture": "x86_64", "avx512_bf16": True})
    assert P.resolve_precision("auto", "torch", "cuda:0")[0] == "fp32"  # GPUs choose their precision at export
    assert P.resolve_precision("auto", "onnxruntime")[0] == "fp32"
    assert P.resolve_precision("fp32", "torch") == ("fp32", "requested")
    with pytest.raises(P.PrecisionError, match="bf16 needs the torch backend"):
        P.resolve_precision("bf16", "onnxruntime")
    with pytest.raises(P.PrecisionError, match="choose one of"):
        P.resolve_precision("int8", "torch")
    capabilities(monkeypatch, {"architecture": "x86_64", "avx2": True}, onednn=False)
    with caplog.at_level(logging.WARNING):
        precision, reason = P.resolve_precision("bf16", "torch")  # asked for: served, but said to be emulated
    assert precision == "bf16" and "emulated" in reason and "without native bf16" in caplog.text


# ------------------------------------------------------------------------------------------ agreement


def metadata(task: str, thresholds: tuple[float, ...] | None = None) -> ModelMetadata:
    return ModelMetadata(
        name="m",
        task=task,
        labels=("a", "b", "c"),
        in_channels=1,
        image_size=8,
        mean=(0.5,),
        std=(0.5,),
        iterations=1,
        thresholds=thresholds,
    )


def test_agreement_is_top1_for_single_label_and_the_label_set_for_multi_label():
    fp32 = np.array([[3.0, 1.0, -2.0], [0.2, 0.1, -1.0], [-3.0, 2.0, 0.5], [1.0, 0.9, 0.8]])
    bf16 = np.array([[2.9, 1.1, -2.0], [0.1, 0.2, -1.0], [-3.0, 2.0, -0.6], [1.0, 0.9, 0.8]])
    # row 1 swaps its top two; row 2 keeps its top-1 but drops label c below the threshold
    assert P.agreement(fp32, bf16, metadata("single_label")) == 0.75
    assert P.agreement(fp32, bf16, metadata("multi_label")) == 0.75  # 0.5 thresholds: row 1's set {a, b} holds
    assert P.agreement(fp32, bf16, metadata("multi_label", (0.5, 0.5, 0.9))) == 1.0  # c never passes 0.9
    assert P.agreement(fp32, fp32, metadata("multi_label")) == 1.0


def test_check_keeps_bf16_and_serves_it(models):
    runtime, choice = P.open_torch(models["cifar10"], requested="bf16", bound=0.5)
    assert runtime.precision == choice.precision == "bf16" and choice.check is not None
    assert choice.check.images == P.SAMPLE_SIZE and choice.check.measure == "top-1" and choice.check.passed
    assert "agreement" in runtime.precision_reason
    x = P.sample_images(runtime.metadata, 4)
    fp32 = runtime.at_precision("fp32").predict(x)
    bf16 = runtime.predict(x)
    assert bf16.dtype == np.float32 and not np.array_equal(bf16, fp32)  # autocast really ran
    np.testing.assert_allclose(bf16, fp32, atol=0.1)
    assert runtime.at_precision("fp32").model is runtime.model  # the reference shares the weights
    with pytest.raises(ValueError, match="precision must be one of"):
        runtime.at_precision("int8")


@pytest.mark.parametrize("name", ["multimnist-capsnet-small", "multimnist-em-small"])
def test_bf16_serves_the_comparison_routings(name, tmp_path):
    """Dynamic routing (squash of long vote sums) and EM (log-variances, Gaussians) under bf16 autocast: the check
    runs on them like on ours, and what it keeps is finite and near fp32 (measured 4.1e-2 and 6.0e-2 at most on
    17 images of these tiny models)."""
    tiny_model(name).save(tmp_path / name)
    runtime, choice = P.open_torch(tmp_path / name, requested="bf16", bound=0.5)
    assert choice.check is not None and choice.check.measure == "label set" and choice.check.images == P.SAMPLE_SIZE
    x = P.sample_images(runtime.metadata, 8)
    fp32 = runtime.at_precision("fp32").predict(x)
    bf16 = runtime.at_precision("bf16").predict(x)
    assert np.isfinite(bf16).all() and not np.array_equal(bf16, fp32)  # autocast really ran
    np.testing.assert_allclose(bf16, fp32, atol=0.2)


def test_check_falls_back_to_fp32_below_the_bound(models, caplog):
    settings = Settings(model=str(models["contrived"]), backend="torch", precision="bf16")
    with caplog.at_level(logging.WARNING):
        runtime, explainer, _ = open_model(settings.model, settings)  # the service's own loading
    assert runtime.precision == "fp32" and explainer is runtime
    assert "falling back to fp32" in caplog.text and "top-1 agreement" in caplog.text
    assert runtime.precision_reason.startswith("fell back from bf16")
    agreement = float(re.search(r"top-1 agreement ([0-9.]+) on 64 seeded images", runtime.precision_reason)[1])
    assert agreement < 0.5  # bf16 ties every class: only images fp32 puts in class 0 agree
    fp32 = load_runtime(models["contrived"], "torch", precision="fp32")
    x = P.sample_images(fp32.metadata, 8)
    np.testing.assert_array_equal(runtime.predict(x), fp32.predict(x))


def test_auto_on_onnxruntime_serves_the_graph(monkeypatch):
    capabilities(monkeypatch, {"architecture": "x86_64", "avx512_bf16": True})
    runtime, explainer, _ = open_model(str(SHIPPED), Settings(model=str(SHIPPED), precision="auto"))
    assert (runtime.backend, runtime.precision, explainer.precision) == ("onnxruntime", "fp32", "fp32")
    assert "exported graph" in runtime.precision_reason


def test_open_torch_refuses_a_bound_outside_0_1(models):
    with pytest.raises(P.PrecisionError, match=r"\[0, 1\]"):
        P.open_torch(models["cifar10"], requested="bf16", bound=1.5)


# ------------------------------------------------------------------------------------------ capserve verify


def test_verify_compares_a_model_folder_at_bf16(models, capsys):
    assert main(["verify", str(models["contrived"]), "--precision", "bf16"]) == 1
    out = capsys.readouterr().out
    assert "bf16, torch" in out and "FAIL" in out and f"top-1 agree >= {P.BF16_MIN_AGREEMENT:g}" in out
    assert f"\n{P.SAMPLE_SIZE:>5} " in out  # the service's sample: one row of SAMPLE_SIZE images
    assert main(["verify", str(models["cifar10"]), "--precision", "bf16", "--min-agreement", "0.5"]) == 0
    assert "passed" in capsys.readouterr().out


def test_verify_refuses_bf16_for_an_onnx_file(capsys):
    onnx = SHIPPED / "model.onnx"
    assert main(["verify", str(onnx), "--against", str(SHIPPED), "--precision", "bf16"]) == 2
    assert "bf16 needs the torch backend" in capsys.readouterr().err
    assert main(["verify", str(onnx)]) == 2  # an ONNX file needs --against
    assert "give --against" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ real server at bf16


def test_real_server_serves_bf16(models, tmp_path):
    proc, url, log = start_server(
        tmp_path,
        CAPSERVE_MODEL=str(models["cifar10"]),
        CAPSERVE_MULTILABEL_MODEL=str(models["multimnist"]),
        CAPSERVE_BACKEND="torch",
        CAPSERVE_PRECISION="bf16",
        CAPSERVE_BF16_MIN_AGREEMENT="0.5",  # random tiny models have near-ties; the bound is tested above
    )
    try:
        wait_ready(proc, url, log)
        with httpx.Client(base_url=url, timeout=60) as client:
            info = client.get("/model").json()
            for key in ("single_label", "multi_label", "explain"):
                assert (info[key]["backend"], info[key]["precision"]) == ("torch", "bf16"), info[key]
                assert "agreement" in info[key]["precision_reason"]
            data = random_png(3)
            r = client.post("/classify", files={"image": ("a.png", data, "image/png")}, data={"top_k": "10"})
            assert r.status_code == 200, r.text
            bf16 = load_runtime(models["cifar10"], "torch", precision="bf16")
            logits = bf16.predict(preprocess(data, bf16.metadata))[0]  # (C,)
            expected = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            got = {p["index"]: p["probability"] for p in r.json()["predictions"]}
            np.testing.assert_allclose([got[i] for i in range(10)], expected, atol=1e-3)
            r = client.post("/explain", files={"image": ("a.png", data, "image/png")})
            assert r.status_code == 200, r.text
            assert r.json()["prediction"]["index"] == int(expected.argmax())
            r = client.post("/multilabel", files={"image": ("d.png", random_png(4, (36, 36)), "image/png")})
            assert r.status_code == 200, r.text
    finally:
        stop(proc)
