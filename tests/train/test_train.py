"""Training: schedules, outputs, exact resumes, DDP, the best epoch, evaluation and calibration, CLI errors."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from support import real_images
from support.busy import busy_core
from support.data import cfg, write_easy_cifar10, write_mnist
from support.models import tiny_input, tiny_model, tiny_overrides

import capserve
import capserve.data
import capserve.train.cli
import capserve.train.loop
from capserve.cli import main
from capserve.data.preprocess import normalize
from capserve.evaluate import metrics as ev
from capserve.files import swap_names
from capserve.train.amp import deterministic_kernels
from capserve.train.config import TrainConfig, lr_factor
from capserve.train.loop import drop_unsaved_epochs, improves, train
from capserve.train.state import load_state, save_state

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cifar(tmp_path_factory) -> Path:
    return write_easy_cifar10(tmp_path_factory.mktemp("cifar"))


@pytest.fixture(scope="module")
def mnist(tmp_path_factory) -> Path:
    return write_mnist(tmp_path_factory.mktemp("mnist"), n_train=120, n_test=40)


def test_schedules():
    assert lr_factor("step", 0.0, 149, 350) == 1 and lr_factor("step", 0.5, 150, 350) == pytest.approx(0.1)
    assert lr_factor("step", 0.9, 250, 350) == pytest.approx(0.01)
    assert lr_factor("cosine", 0, 0, 1) == 1 and lr_factor("cosine", 1, 0, 1) == pytest.approx(0)
    assert lr_factor("onecycle", 0, 0, 1) == pytest.approx(1 / 25) and lr_factor("onecycle", 0.15, 0, 1) == 1
    assert lr_factor("onecycle", 1.0, 0, 1) == pytest.approx(0)


def test_training_reduces_loss_and_writes_outputs(cifar, tmp_path):
    out = tmp_path / "run"
    summary = train(
        cfg(
            "cifar10-simple",
            cifar,
            out,
            epochs=6,
            batch_size=8,
            lr=0.1,
            schedule="cosine",
            amp="bf16",
            channels_last=True,
            grad_clip=5.0,
        )
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and rows[-1]["train_loss"] < 0.7 * rows[0]["train_loss"]
    assert {"val_acc", "val_loss", "lr", "images_per_s"} <= set(rows[0])
    model = capserve.load(out / "best")  # best/ is a plain model folder
    # the summary's figures are best/'s: its validation accuracy is the best epoch's, its test accuracy is best/
    # scored once on the test split (recomputed here from the weights), and it learned the colour-coded classes
    assert summary["best_val_acc"] == max(row["val_acc"] for row in rows)
    assert rows[summary["best_epoch"] - 1]["val_acc"] == summary["best_val_acc"]
    test = capserve.data.load_test("cifar10", cifar)
    with torch.no_grad():
        predicted = model(normalize(test.images, model.config.mean, model.config.std)).argmax(1)
    assert summary["test_acc"] == pytest.approx((predicted == test.targets).float().mean().item(), abs=1e-6)
    assert summary["test_acc"] >= 0.5  # 10 classes (chance 0.1) that differ by colour; measured 0.80 (16/20)
    assert model.config.extra["data"] == {"dataset": "cifar10", "val_size": 12}
    assert (out / "curves.png").stat().st_size > 0
    assert set(os.listdir(out / "last")) == {
        "model.safetensors",
        "config.json",
        "optimizer.safetensors",
        "trainer.json",
    }


@pytest.mark.parametrize(("optimizer", "backbone_loss"), [("sgd", 0.0), ("adam", 0.0), ("adamw", 0.5)])
def test_resume_continues_exactly(cifar, tmp_path, optimizer, backbone_loss):
    whole = tmp_path / "whole"
    lr = 0.05 if optimizer == "sgd" else 1e-3
    recipe = dict(test=False, optimizer=optimizer, lr=lr, backbone_loss=backbone_loss)
    whole_summary = train(cfg("cifar10-simple", cifar, whole, **recipe))  # 2 × 3 steps
    part = tmp_path / "part"
    train(cfg("cifar10-simple", cifar, part, max_steps=4, **recipe))  # inside epoch 2
    state = json.loads((part / "last" / "trainer.json").read_text())["state"]
    assert (state["epoch"], state["batch"], state["step"]) == (1, 1, 4)
    # the resumed run ends as the uninterrupted one did: learned (0) or not (1), never a usage error (2)
    assert main(["train", "--resume", str(part)]) == (1 if whole_summary.get("learned") is False else 0)
    a, b = load_file(str(whole / "last" / "model.safetensors")), load_file(str(part / "last" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa = load_file(str(whole / "last" / "optimizer.safetensors"))
    ob = load_file(str(part / "last" / "optimizer.safetensors"))
    assert all(torch.equal(oa[k], ob[k]) for k in oa if k.startswith(("state.", "backbone_head.")))
    assert bool([k for k in oa if k.startswith("backbone_head.")]) == bool(backbone_loss)  # --backbone-loss's own
    moments = {"momentum_buffer"} if optimizer == "sgd" else {"exp_avg", "exp_avg_sq", "step"}
    assert {k.split(".", 2)[2] for k in oa if k.startswith("state.")} == moments  # the optimizer asked for


def test_the_backbone_loss_reaches_the_backbone_and_nothing_else(cifar, tmp_path):
    """One step from the same weights with and without ``--backbone-loss``: the backbone steps differently, every
    other weight (the capsules', whose gradient is their own loss's) steps alike, and the run reports the capsules'
    loss alone; the saved models hold the same tensors."""
    runs = {}
    for weight in (0.0, 2.0):
        out = tmp_path / str(weight)
        train(cfg("cifar10-simple", cifar, out, test=False, max_steps=1, optimizer="adamw", backbone_loss=weight))
        metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
        runs[weight] = load_file(str(out / "last" / "model.safetensors")), metrics["train_loss"]
    (without, loss_without), (with_head, loss_with) = runs[0.0], runs[2.0]
    assert without.keys() == with_head.keys()
    moved = {k for k in without if not torch.equal(without[k], with_head[k])}
    assert moved and all(k.startswith("backbone.") for k in moved), moved
    assert {k for k in without if k.startswith("backbone.") and k.endswith("weight")} <= moved
    assert loss_with == loss_without


def test_best_epoch_breaks_accuracy_ties_by_validation_loss():
    assert improves(0.0, 13.5, None, None)  # the first epoch
    assert improves(0.1, 20.0, 0.0, 13.5)  # accuracy decides first
    assert not improves(0.0, 14.0, 0.1, 13.5)
    assert improves(0.0, 11.4, 0.0, 13.5) and not improves(0.0, 13.6, 0.0, 13.5)  # a tie: the lower loss
    assert not improves(0.5, None, 0.5, None)  # no validation split: the first of equal training accuracies


@pytest.mark.parametrize("backbone_loss", ["0", "1"])
def test_ddp_two_cpu_processes_match_one(mnist, tmp_path, backbone_loss):
    # multimnist models have no BatchNorm: 2 ranks × 8 images must equal 1 process × 16 images, and so must the
    # backbone classifier of --backbone-loss, whose gradients DDP does not average for it
    overrides = json.dumps(tiny_overrides("multimnist-matrix-small")["capsules"][0].__dict__)
    args = [
        "train",
        "--model",
        "multimnist-matrix-small",
        "--data",
        str(mnist),
        "--epochs",
        "1",
        "--epoch-size",
        "48",
        "--batch-size",
        "16",
        "--val-size",
        "20",
        "--eval-batch-size",
        "10",
        "--no-test",
        "--device",
        "cpu",
        "--set",
        "backbone_channels=8",
        "--set",
        "primary_types=4",
        "--set",
        f'capsules=[{overrides}, {{"kind": "fc", "types": 5}}]',
        "--backbone-loss",
        backbone_loss,
    ]
    single = tmp_path / "single"
    # 1 (and the same from torchrun): three steps need not beat the prior; the weights are what this test compares
    assert main([*args, "--out", str(single)]) == 1
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "capserve.cli",
        *args,
        "--out",
        str(tmp_path / "ddp"),
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "did not learn" in result.stderr, result.stderr[-3000:]
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["steps"] == 3
    a = load_file(str(single / "last" / "model.safetensors"))
    b = load_file(str(tmp_path / "ddp" / "last" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    head_a = load_file(str(single / "last" / "optimizer.safetensors"))
    head_b = load_file(str(tmp_path / "ddp" / "last" / "optimizer.safetensors"))
    head = [k for k in head_a if k.startswith("backbone_head.")]
    assert len(head) == (2 if backbone_loss == "1" else 0)
    for k in head:
        torch.testing.assert_close(head_a[k], head_b[k], rtol=1e-4, atol=1e-5)
    va = [json.loads(line)["val_acc"] for line in (single / "metrics.jsonl").read_text().splitlines()]
    vb = [json.loads(line)["val_acc"] for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert va == vb  # validation sharded over 2 ranks and all-reduced


def test_evaluate_and_calibrate(mnist, cifar, tmp_path, capsys):
    train(cfg("multimnist-matrix-small", mnist, tmp_path / "mm", epochs=1, epoch_size=32, val_size=40, test=False))
    best = tmp_path / "mm" / "best"
    assert (
        main(
            [
                "evaluate",
                str(best),
                "--data",
                str(mnist),
                "--iterations",
                "1,2,3",
                "--calibrate",
                "--limit",
                "300",
                "--out",
                str(tmp_path / "ev"),
            ]
        )
        == 0
    )
    thresholds = capserve.read_config(best).thresholds
    assert thresholds is not None and len(thresholds) == 10
    model = capserve.load(best)
    c = model.config

    def logits(split, T=None):
        with torch.no_grad():
            return model(normalize(split.images, c.mean, c.std), iterations=T)

    def f1(decided, truth):  # per class, written out here
        tp, fp, fn = (decided & truth).sum(0), (decided & ~truth).sum(0), (~decided & truth).sum(0)
        return 2 * tp / (2 * tp + fp + fn).clamp_min(1)

    # each stored threshold is a grid value (0.05 … 0.95) with the best validation F1 of its class
    val = capserve.data.load_validation("multimnist", mnist, 40)
    probabilities, truth = torch.sigmoid(logits(val)), val.targets > 0.5
    grid = [round(0.05 * i, 2) for i in range(1, 20)]
    assert all(t in grid for t in thresholds)
    best_f1 = torch.stack([f1(probabilities >= t, truth) for t in grid]).max(0).values
    always = f1(torch.ones_like(truth), truth)  # answering the label for every image
    chosen = f1(probabilities >= torch.tensor(thresholds), truth)
    for k, t in enumerate(thresholds):  # a class no threshold helps beyond "always" keeps 0.5
        assert (t == 0.5) if best_f1[k] <= always[k] + 1e-9 else chosen[k] == pytest.approx(best_f1[k].item())
    # the report's figures are the model's on the first 300 test images with those thresholds, per T
    report = json.loads((tmp_path / "ev" / "evaluation.json").read_text())
    assert report["images"] == 300 and set(report["results"]) == {"1", "2", "3"}
    test = capserve.data.load_test("multimnist", mnist).subset(torch.arange(300))
    for T in (1, 2, 3):
        decided, truth = torch.sigmoid(logits(test, T)) >= torch.tensor(thresholds), test.targets > 0.5
        result = report["results"][str(T)]
        assert result["exact_match"] == pytest.approx((decided == truth).all(1).float().mean().item(), abs=1e-6)
        per_label = dict(zip(report["labels"], f1(decided, truth).tolist(), strict=True))  # keyed by label name
        assert result["f1"] == pytest.approx(per_label, abs=1e-6)
    assert "per-class F1" in capsys.readouterr().out
    train(cfg("cifar10-simple", cifar, tmp_path / "c", epochs=1, test=False))
    assert main(["evaluate", str(tmp_path / "c" / "best"), "--data", str(cifar), "--iterations", "1,2"]) == 0
    out = capsys.readouterr().out
    model, test = capserve.load(tmp_path / "c" / "best"), capserve.data.load_test("cifar10", cifar)
    c = model.config
    for T in (1, 2):  # the printed top-1 per T is the model's on the test split
        top1 = (logits(test, T).argmax(1) == test.targets).float().mean().item()
        assert f"{T:>3} {100 * top1:11.2f}%" in out
    confusion = [[int(v) for v in line.split()[1:]] for line in out.split("columns predicted):\n")[1].splitlines()]
    assert sum(map(sum, confusion)) == len(test) and len(confusion) == 10  # every test image counted once


def test_metrics():
    logits = torch.tensor([[3.0, 1, 0], [0, 2, 1], [0, 1, 2], [2, 0, 1]])
    m = ev.single_label_metrics(logits, torch.tensor([0, 1, 1, 2]))
    assert m["top1"] == 0.5 and m["top3"] == 1.0 and m["confusion"] == [[1, 0, 0], [0, 1, 1], [1, 0, 0]]
    targets = torch.tensor([[1.0, 0], [1, 1], [0, 1]])
    mm = ev.multi_label_metrics(torch.tensor([[2.0, -1], [1, -0.5], [-1, 1]]), targets, None)
    assert mm["exact_match"] == pytest.approx(2 / 3) and mm["f1"] == [1.0, pytest.approx(2 / 3)]
    # ranked recall ignores thresholds: images 0 and 2 rank their one label first, image 1 has both of its two
    assert mm["ranked_recall"] == 1.0
    scores = torch.tensor([[0.0, 1, 2], [3, 2, 1], [1, 2, 3]])  # labels: {0}, {0, 2}, {1, 2}
    ranked = ev.ranked_recall(scores, torch.tensor([[True, False, False], [True, False, True], [False, True, True]]))
    assert ranked == pytest.approx(3 / 5)  # image 0: 0 of 1; image 1: 1 of 2 (class 0); image 2: 2 of 2
    # class 1's positives score sigmoid(-0.5) and sigmoid(1): a threshold below 0.38 gets them both
    assert ev.fit_thresholds(torch.tensor([[2.0, -1.5], [1, -0.5], [-1, 1]]), targets)[1] < 0.38


def test_optimizer_flags(cifar, tmp_path, capsys, monkeypatch):
    runs: list[TrainConfig] = []
    monkeypatch.setattr(capserve.train.cli, "train", lambda c, resume=None: runs.append(c) or {})
    base = ["train", "--model", "cifar10-simple", "--data", str(cifar), "--out", str(tmp_path)]
    assert main([*base, "--optimizer", "adam"]) == 0 and main(base) == 0
    # each optimizer's own default lr; Adam records no momentum (it has none); "auto" is resolved by the set-up
    assert [(c.optimizer, c.lr, c.momentum) for c in runs] == [("adam", 1e-3, None), ("auto", None, None)]
    assert TrainConfig(model="cifar10-simple", data="d", out="o", optimizer="adam").lr == 1e-3  # the API's too
    assert main([*base, "--optimizer", "adam", "--momentum", "0.5"]) == 2
    assert "--momentum is SGD's" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # argparse's own usage error
        main([*base, "--optimizer", "lion"])
    assert exit_.value.code == 2 and "invalid choice: 'lion'" in capsys.readouterr().err


def test_cli_errors(cifar, tmp_path, capsys):
    assert main(["train", "--model", "nope", "--data", str(cifar), "--out", str(tmp_path)]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert main(["train", "--model", "cifar10-simple", "--data", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert (
        main(["train", "--model", "cifar10-simple", "--data", str(cifar), "--out", str(tmp_path), "--set", "pose_dim"])
        == 2
    )
    assert "key=value" in capsys.readouterr().err
    assert main(["train", "--model", "cifar10-simple"]) == 2
    assert "missing --data, --out" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "no checkpoint to resume" in capsys.readouterr().err
    assert main(["evaluate", str(tmp_path), "--data", str(cifar)]) == 2
    assert "not a model folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value"), [("--lr", "nan"), ("--time-budget", "nan"), ("--weight-decay", "inf"), ("--grad-clip", "inf")]
)
def test_a_nan_or_inf_flag_is_refused_in_one_line(cifar, tmp_path, capsys, flag, value):
    """nan compares False with every bound (``nan <= 0`` is False): without a check of its own it passes them all and
    trains on nothing, or never stops. Refused before anything is written."""
    out = tmp_path / "run"
    assert main(["train", "--model", "cifar10-simple", "--data", str(cifar), "--out", str(out), flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"capserve train: error: {flag} must be a finite number, got {value}"] and not out.exists()


KILLED_RUN = """
import sys
sys.path.insert(0, sys.argv[1])
from support.data import cfg
from capserve.train.loop import train
train(cfg("cifar10-simple", sys.argv[2], sys.argv[3], test=False, epochs=int(sys.argv[4]), batch_size=8))
"""


def test_a_run_killed_at_a_random_point_resumes_to_the_uninterrupted_weights(cifar, tmp_path):
    """SIGKILL at a random moment after the first checkpoint (mid-epoch, or while last/ or best/ is being written),
    then --resume: the run continues from the last whole checkpoint and ends with the uninterrupted run's weights
    (CPU, fixed seed: the resumed steps are the same steps), with no half-written folder left behind."""
    epochs = 12
    whole = tmp_path / "whole"
    summary = train(cfg("cifar10-simple", cifar, whole, test=False, epochs=epochs, batch_size=8))
    part = tmp_path / "part"
    for latest in (0.4, 0.2, 0.1, 0.05, 0.02):  # a run that outruns the kill (a fast machine) runs again, sooner
        shutil.rmtree(part, ignore_errors=True)
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLED_RUN, str(ROOT / "tests"), str(cifar), str(part), str(epochs)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 120
            first = part / "last" / "trainer.json"
            while not first.is_file() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            delay = random.Random().uniform(0, latest)  # a random point of the epochs that follow
            time.sleep(delay)
            assert proc.poll() is None, f"the run ended before the kill ({delay:.3f} s after last/)"
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        saved = json.loads((part / "last" / "trainer.json").read_text())["state"]
        if saved["epoch"] < epochs:
            break
    assert saved["epoch"] < epochs  # killed before the end
    assert main(["train", "--resume", str(part)]) == (1 if summary.get("learned") is False else 0)
    for folder in ("last", "best"):
        a, b = load_file(str(whole / folder / "model.safetensors")), load_file(str(part / folder / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (folder, delay, saved)
    assert not [p.name for p in part.iterdir() if p.name.startswith(".")]  # no partial or set-aside folder
    logged = [json.loads(line) for line in (part / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["train_loss"]) for r in logged] == [(r["epoch"], r["train_loss"]) for r in expected]


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """The real CIFAR-10 photographs of three classes (of the 200 fixtures) as a user's folder of label folders."""
    images, classes = real_images.cifar10()
    root = tmp_path_factory.mktemp("photos")
    for k, (image, label) in enumerate(zip(images, classes, strict=True)):
        if label >= 3:
            continue
        (root / f"class{label}").mkdir(exist_ok=True)
        Image.fromarray(image.transpose(1, 2, 0)).save(root / f"class{label}" / f"{k}.png")
    return root


def test_seeded_runs_on_a_busy_machine_match_and_a_killed_run_resumes_to_them(photos, tmp_path):
    """``capserve train --data FOLDER`` as a user runs it (the own-data model and recipe, whose kernels are the
    ones that matter), on two threads, with another process spinning beside it: two runs with one seed end with
    the same weights and optimizer state to the bit, and so does a run killed after its first checkpoint and
    resumed (``deterministic_kernels``)."""
    args = [sys.executable, "-m", "capserve.cli", "train", "--data", str(photos), "--epochs", "2", "--seed", "3"]
    args += ["--batch-size", "16", "--no-test", "--device", "cpu"]  # a smaller batch: the weights' gradients are whole
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}

    def run(out: Path) -> None:
        result = subprocess.run([*args, "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode in (0, 1) and "Traceback" not in result.stderr, result.stderr[-3000:]

    with busy_core():
        run(tmp_path / "a")
        run(tmp_path / "b")
        killed = subprocess.Popen([*args, "--out", str(tmp_path / "c")], env=env, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 300
            while not (tmp_path / "c" / "last" / "trainer.json").is_file() and time.monotonic() < deadline:
                time.sleep(0.01)
            killed.send_signal(signal.SIGKILL)
        finally:
            killed.kill()
            killed.wait()
        saved = json.loads((tmp_path / "c" / "last" / "trainer.json").read_text())["state"]
        assert saved["epoch"] < 2, saved  # killed before the end
        resumed = subprocess.run([*args[:3], "train", "--resume", str(tmp_path / "c")], env=env, capture_output=True)
        assert resumed.returncode in (0, 1), resumed.stderr[-3000:]
    for other in ("b", "c"):
        for name in ("model.safetensors", "optimizer.safetensors"):
            a, b = (load_file(str(tmp_path / run / "last" / name)) for run in ("a", other))
            assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == [], (other, name)


def test_a_cpu_run_trains_under_deterministic_kernels_and_restores_the_setting(cifar, tmp_path, monkeypatch):
    """``train`` on a CPU runs every step with ``torch.use_deterministic_algorithms`` on, whatever the caller had,
    without filling new tensors first (a cost that buys nothing here), and leaves the caller's settings (the warn-only
    flag too) as they were, also when training fails."""
    seen = []
    real = capserve.train.loop._train

    def spy(*args, **kwargs):
        seen.append((torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory))
        return real(*args, **kwargs)

    monkeypatch.setattr(capserve.train.loop, "_train", spy)
    train(cfg("cifar10-simple", cifar, tmp_path / "run", test=False, max_steps=1))
    assert seen == [(True, False)] and not torch.are_deterministic_algorithms_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        monkeypatch.setattr(capserve.train.loop, "_train", lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
        with pytest.raises(RuntimeError):
            train(cfg("cifar10-simple", cifar, tmp_path / "failed", test=False))
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    with deterministic_kernels(torch.device("meta")):  # not a CPU: the caller's setting stands
        assert not torch.are_deterministic_algorithms_enabled()


def test_a_new_run_in_an_earlier_runs_folder_logs_and_sums_up_only_itself(cifar, tmp_path, caplog):
    out = tmp_path / "run"
    train(cfg("cifar10-simple", cifar, out, epochs=2))
    with caplog.at_level("WARNING", logger="capserve"):
        summary = train(cfg("cifar10-simple", cifar, out, epochs=1))
    assert [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert summary["best_epoch"] == 1 and json.loads((out / "summary.json").read_text()) == summary
    assert "holds an earlier run" in caplog.text


def test_resume_forgets_epochs_logged_but_not_saved(tmp_path):
    """A kill after an epoch's metrics line but before its checkpoint: that epoch runs again, and is logged once."""
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"epoch": e, "epoch_complete": True, "train_loss": 1.0 / e} for e in (1, 2, 3)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"epoch": 4, "epo')  # a line cut by the kill
    drop_unsaved_epochs(metrics, saved_epochs=2)
    assert [json.loads(line)["epoch"] for line in metrics.read_text().splitlines()] == [1, 2]


def test_load_state_brings_back_a_checkpoint_a_kill_set_aside(tmp_path):
    """Through the Python API, as ``--resume`` does: a kill between ``last/``'s two renames leaves it set aside under
    its hidden name; ``load_state`` brings it back, with its weights, optimizer moments and counters."""
    model = tiny_model("cifar10-simple").train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(tiny_input(model, 2)).sum().backward()
    opt.step()
    state = {"epoch": 1, "batch": 0, "step": 1, "elapsed": 1.5, "best_acc": 0.5, "best_epoch": 1}
    last = tmp_path / "last"
    save_state(last, model, opt, None, state, cfg("cifar10-simple", tmp_path, tmp_path))
    _, aside = swap_names(last)
    last.rename(aside)  # killed after setting last/ aside, before the new one came in
    resumed = tiny_model("cifar10-simple")
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    assert load_state(last, resumed, resumed_opt, None, torch.device("cpu")) == state
    saved, loaded = model.state_dict(), resumed.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    moments, loaded_moments = opt.state_dict()["state"], resumed_opt.state_dict()["state"]  # {parameter: {...}}
    assert moments.keys() == loaded_moments.keys()
    assert all(torch.equal(moments[i]["momentum_buffer"], loaded_moments[i]["momentum_buffer"]) for i in moments)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]
