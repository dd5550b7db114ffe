"""Your own images: folders and CSVs the tests generate (PNG, JPEG, grayscale, RGBA, palette, a corrupt file, a text
file, nested train/val/test, label names with spaces and non-ASCII letters), through scan → cache → train →
evaluate → fine-tune → ONNX → the real `bentoml serve`."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from support.data import write_easy_cifar10
from support.models import tiny_overrides
from support.own import LABELS, SIZE, picture, write_csv, write_folder, write_images
from support.server import start_server, stop, wait_ready

import capserve
import capserve.data.splits
from capserve.cli import main
from capserve.data.cache import CACHE_FILE
from capserve.data.images import preprocess
from capserve.data.own import Sample, carve, scan
from capserve.errors import DataError
from capserve.evaluate import evaluator as evaluate_module
from capserve.evaluate.cli import print_confusion
from capserve.model.capsnet import CapsNet
from capserve.routing import fused as kernel
from capserve.runtime.metadata import ModelMetadata
from capserve.train.config import TrainConfig
from capserve.train.loop import train
from capserve.train.state import init_from


def multi_label_csv(root: Path, n: int = 36) -> Path:
    """Pictures holding one or two colours side by side; labels are single words, split column train/val/test."""
    names = {"red": "red fox", "blue": "blue whale", "green": "grüne Wiese"}
    rows = []
    rng = np.random.default_rng(0)
    (root / "img").mkdir(parents=True)
    for i in range(n):
        chosen = sorted(rng.choice(list(names), size=1 + i % 2, replace=False))
        halves = [np.asarray(Image.open(io.BytesIO(picture(names[c], i)))) for c in chosen]
        pixels = np.concatenate([h[:, : 24 // len(halves)] for h in halves], axis=1)
        Image.fromarray(pixels).save(root / "img" / f"{i}.png")
        split = "test" if i % 6 == 5 else "val" if i % 6 == 4 else "train"
        rows.append((f"img/{i}.png", " ".join(chosen), split))
    return write_csv(root, rows)


def config(data: Path, out: Path, model: str = "cifar10-simple", **kw) -> TrainConfig:
    base = dict(
        overrides=tiny_overrides(model),
        epochs=2,
        batch_size=8,
        lr=0.05,
        eval_batch_size=16,
        device="cpu",
        image_size=SIZE,
        schedule="cosine",
    )
    return TrainConfig(model=model, data=str(data), out=str(out), **{**base, **kw})


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """train/ (34 per label and one truncated file: under 1 % fail) and test/ (4 per label); no val/: it is carved."""
    root = write_folder(tmp_path_factory.mktemp("own") / "photos", train=34, test=4)
    (root / "train" / LABELS[1] / "broken.png").write_bytes(picture(LABELS[1], 0)[:60])  # truncated PNG
    return root


@pytest.fixture(scope="module")
def run(folder, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("run") / "mine"
    return out, train(config(folder, out, epochs=4, val_size=6))


# ------------------------------------------------------------------------------------------------ data


def test_folder_labels_splits_and_ignored_files(tmp_path):
    root = write_folder(tmp_path / "flat", train=5)
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.png").write_bytes(picture(LABELS[0], 1))
    manifest = scan(root)
    assert manifest.kind == "folder" and manifest.task == "single_label" and not manifest.named_splits
    assert manifest.labels == LABELS == ("blue whale", "grüne Wiese", "red fox")  # exact names, sorted
    assert len(manifest.splits["train"]) == 15  # notes.txt and the hidden folder ignored, nested/ found
    assert any("nested" in s.where for s in manifest.splits["train"])
    named = scan(write_folder(tmp_path / "named", train=3, val=2, test=1))
    assert named.named_splits and {k: len(v) for k, v in named.splits.items()} == {"train": 9, "val": 6, "test": 3}


def test_stratified_carve_is_seeded_and_keeps_every_label():
    samples = [Sample(Path(f"{c}{i}"), (c,), "") for c, n in (("a", 80), ("b", 15), ("c", 5)) for i in range(n)]
    train_idx, val_idx = carve(samples, 20, stratified=True)
    assert (train_idx, val_idx) == carve(samples, 20, stratified=True)  # fixed seed
    counts = {c: sum(samples[i].labels[0] == c for i in val_idx) for c in "abc"}
    assert counts == {"a": 16, "b": 3, "c": 1} and len(train_idx) == 80
    assert sorted(train_idx + val_idx) == list(range(100))
    tiny = [Sample(Path(c), (c,), "") for c in "abc"] + [Sample(Path("a2"), ("a",), "")]
    with pytest.raises(DataError, match="without a training image"):
        carve(tiny, 2, stratified=True)  # only one a can go: b and c have a single image each
    assert capserve.data.splits.resolve_val_size(0.1, 100) == 10 and capserve.data.splits.resolve_val_size(7, 100) == 7
    assert capserve.data.splits.parse_val_size("10%") == 0.1 and capserve.data.splits.parse_val_size("500") == 500


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d, "no images found"),
        (lambda d: ([(d / f"{i}.png").write_bytes(picture(LABELS[0], i)) for i in range(3)], d)[1], "3 images lie"),
        (
            lambda d: (
                write_images(d, 2),
                [p.unlink() for p in (d / LABELS[1]).rglob("*.*")],
                [p.unlink() for p in (d / LABELS[2]).rglob("*.*")],
                d,
            )[-1],
            "1 label folder ('blue whale')",
        ),
        (
            lambda d: (
                write_images(d / "train", 2),
                write_images(d / "val", 1),
                (d / "val" / "zebra").mkdir(),
                (d / "val" / "zebra" / "z.png").write_bytes(picture(LABELS[0], 1)),
                d,
            )[-1],
            "'zebra' (first in val: val/zebra/z.png)",
        ),
        (lambda d: write_csv(d, [("x.png", "a", "train")], header="file,labels"), "lacks the column(s) image"),
        (
            lambda d: write_csv(d, [("ok.png", "a", "train"), ("../up.png", "b", "train")]),
            "line 3: image path '../up.png' leaves",
        ),
        (lambda d: write_csv(d, [("/etc/passwd", "a", "train")]), "line 2: image path '/etc/passwd' is absolute"),
        (
            lambda d: write_csv(d, [("a.png", "a", "train"), ("b.png", "b", "train"), ("c.png", "c", "val")]),
            "'c' (first in val: data.csv line 4)",
        ),
        (lambda d: write_csv(d, [("a.png", "a", "training")]), "line 2: split 'training'"),
    ],
    ids=[
        "empty",
        "loose-images",
        "single-class",
        "unknown-val-label",
        "csv-columns",
        "csv-escape",
        "csv-absolute",
        "csv-unknown-val-label",
        "csv-split",
    ],
)
def test_clear_errors_without_tracebacks(tmp_path, capsys, make, message):
    (tmp_path / "d").mkdir()
    data = make(tmp_path / "d")
    code = main(["train", "--model", "cifar10-simple", "--data", str(data), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


# ------------------------------------------------------------------------------------------------ training


def test_training_on_a_folder(run, folder):
    out, summary = run
    best = capserve.load(out / "best")
    c = best.config
    assert c.labels == LABELS and c.task == "single_label" and c.image_size == SIZE
    assert c.extra["data"] == {"dataset": "folder", "source": str(folder), "val_size": 6}
    assert summary["skipped_images"] == 1 and summary["labels"] == list(LABELS)
    assert 0 <= summary["test_acc"] <= 1  # test/ evaluated once, at the end
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] and "val_acc" in rows[0]
    assert (out / CACHE_FILE).is_file()
    # served answers name the run, not only its config: two fine-tunes of one config can be told apart
    assert c.extra["name"] == "mine" and ModelMetadata.from_config(c).name == "mine"
    mask = os.umask(0)
    os.umask(mask)
    for weights in (out / "best" / "model.safetensors", out / "last" / "model.safetensors"):
        assert weights.stat().st_mode & 0o777 == 0o666 & ~mask == (out / "best" / "config.json").stat().st_mode & 0o777


def test_resume_reuses_the_cache(run, caplog):
    out, summary = run
    with caplog.at_level(logging.INFO):
        # the run is complete: nothing to train, and the same verdict (exit 1 only for a run at the label prior)
        assert main(["train", "--resume", str(out)]) == (1 if summary.get("learned") is False else 0)
    assert "nothing left to train" in caplog.text
    assert "decoded images reused" in caplog.text and "decoding" not in caplog.text.replace("decoded images", "")


def test_image_size_is_for_own_images(tmp_path, capsys):

    cifar = write_easy_cifar10(tmp_path / "c").parent
    assert (
        main(
            [
                "train",
                "--model",
                "cifar10-simple",
                "--data",
                str(cifar),
                "--out",
                str(tmp_path / "r"),
                "--image-size",
                "16",
            ]
        )
        == 2
    )
    assert "--image-size works with your own images" in capsys.readouterr().err


def test_evaluate_json_and_confusion_png(run, folder, tmp_path, capsys):
    out, _ = run
    assert (
        main(
            [
                "evaluate",
                str(out / "best"),
                "--data",
                str(folder),
                "--iterations",
                "1,2",
                "--json",
                "--out",
                str(tmp_path / "ev"),
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)  # one JSON object and nothing else on stdout
    assert report["images"] == 12 and report["labels"] == list(LABELS) and report["split"] == "test"
    assert report["model"] == "mine"  # the run's name, as the server answers with it, not its architecture's
    m = report["results"]["2"]
    assert set(m) >= {"top1", "top3", "precision", "recall", "f1", "support", "confusion", "macro_f1"}
    # per-label figures keyed by label name (bare lists made a script guess the label order)
    assert m["support"] == dict.fromkeys(LABELS, 4) and sum(map(sum, m["confusion"])) == 12
    assert list(m["f1"]) == list(LABELS) and list(m["precision"]) == list(m["recall"]) == list(LABELS)
    assert Image.open(tmp_path / "ev" / "confusion.png").size[0] > 100
    saved = json.loads((tmp_path / "ev" / "evaluation.json").read_text())
    assert saved["results"]["1"]["support"] == dict.fromkeys(LABELS, 4)
    assert main(["evaluate", str(out / "best"), "--data", str(folder), "--split", "val", "--iterations", "2"]) == 0
    text = capsys.readouterr().out
    assert "grüne Wiese" in text and "precision" in text and "(6 images" in text  # the carved validation split
    bare = write_folder(tmp_path / "unseen", train=2)  # a plain folder: every image is evaluated
    assert main(["evaluate", str(out / "best"), "--data", str(bare), "--iterations", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["images"] == 6


def test_evaluate_prints_a_wide_confusion_matrix_as_its_most_frequent_mistakes(capsys):
    """Up to 30 labels the terminal gets the whole matrix; a 100-label one would be 100 lines of 100 columns, so
    it gets the ten most frequent confusions, most frequent first, and where the whole matrix is written."""
    few = ("cat", "dog", "owl")
    print_confusion([[5, 2, 0], [1, 6, 0], [0, 0, 3]], few, 10)
    assert capsys.readouterr().out.splitlines()[1:] == [
        "       cat     5     2     0",
        "       dog     1     6     0",
        "       owl     0     0     3",
    ]
    labels = tuple(f"{i:02d}" for i in range(100))
    confusion = torch.eye(100, dtype=torch.long) * 9
    for i in range(12):  # twelve mistakes, i + 1 images each: 37 taken for 73 most often
        confusion[(i * 7) % 100, (i * 11 + 3) % 100] = i + 1
    confusion[37, 73] = 40
    print_confusion(confusion.tolist(), labels, 10)
    lines = capsys.readouterr().out.splitlines()
    assert "100 labels" in lines[0] and "evaluation.json" in lines[0] and len(lines) == 11
    assert lines[1].split() == ["37", "taken", "for", "73:", "40", "images"]
    assert lines[-1].split()[-2:] == ["4", "images"]  # the tenth largest of 40, 12, 11, ..., 1
    print_confusion((torch.eye(100, dtype=torch.long) * 9).tolist(), labels, 10)
    assert capsys.readouterr().out.splitlines() == [
        "most frequent confusions of 100 labels (the whole matrix: --out DIR writes evaluation.json and "
        "confusion.png): none"
    ]


def test_evaluate_a_folder_with_only_test_images(run, folder, tmp_path, capsys):
    """A test-only folder is the normal thing to evaluate; it was refused for having no train/ folder."""
    out, _ = run
    only = tmp_path / "only"
    (only / "test").mkdir(parents=True)
    for label in LABELS:
        (only / "test" / label).symlink_to(folder / "test" / label)
    assert main(["evaluate", str(out / "best"), "--data", str(only), "--iterations", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["images"] == 12 and report["results"]["2"]["support"] == dict.fromkeys(LABELS, 4)
    code = main(["train", "--model", "cifar10-simple", "--data", str(only), "--out", str(tmp_path / "r")])
    assert code == 2 and "has a val/ or test/ folder but no train/ folder" in capsys.readouterr().err  # training


def test_evaluate_routes_once_at_the_models_own_iterations_unless_asked(run, folder, monkeypatch, capsys):
    """Without ``--iterations`` an evaluation is one pass over the images at the T the model was trained with (at
    T = 1..5 it took longer than a training epoch on the battery's numbers); ``--iterations`` still sweeps."""
    out, _ = run
    trained = capserve.read_config(out / "best").iterations
    passes = []
    forward = CapsNet.forward
    monkeypatch.setattr(
        CapsNet, "forward", lambda self, x, iterations=None: passes.append(iterations) or forward(self, x, iterations)
    )
    assert main(["evaluate", str(out / "best"), "--data", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["results"]) == {str(trained)} and report["trained_iterations"] == trained
    assert passes == [trained]  # 12 images: one batch, one pass
    passes.clear()
    assert main(["evaluate", str(out / "best"), "--data", str(folder), "--iterations", "1,3", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["results"]) == {"1", "3"} and passes == [1, 3]


def test_a_short_evaluation_routes_eagerly(run, folder, monkeypatch, capsys):
    """``capserve evaluate`` of 500 images at T = 1..3 spent over half its time compiling the fused routing kernel,
    which so few images never pay back: below ``FUSED_MIN_IMAGE_RUNS`` it routes eagerly, above it the kernel runs."""
    out, _ = run
    calls = []
    monkeypatch.setattr(kernel, "FUSED_MIN_VOTES", 1)  # every step of this tiny model would fuse
    monkeypatch.setattr(kernel, "FUSED_MIN_PARENTS", 1)
    monkeypatch.setattr(kernel, "FUSED_BLOCK_BYTES", 1)  # blocks of two rows
    monkeypatch.setattr(kernel, "_fused", lambda u, w, q: calls.append(tuple(u.shape)))  # None: the rows go eager
    argv = ["evaluate", str(out / "best"), "--data", str(folder), "--iterations", "1,2", "--json"]
    assert main(argv) == 0
    short = json.loads(capsys.readouterr().out)
    assert calls == []
    monkeypatch.setattr(evaluate_module, "FUSED_MIN_IMAGE_RUNS", 24)  # 12 images × 2 T: long enough now
    assert main(argv) == 0
    assert calls and json.loads(capsys.readouterr().out)["results"] == short["results"]


@pytest.mark.parametrize("command", ["train", "evaluate"])
def test_a_data_path_that_does_not_exist_says_so_and_writes_nothing(run, tmp_path, capsys, monkeypatch, command):
    """A typo in --data answered with a CIFAR-10 download link and left an empty run folder behind."""
    out, _ = run
    monkeypatch.chdir(tmp_path)
    argv = (
        ["train", "--model", "cifar10-simple", "--out", "runs/new"]
        if command == "train"
        else ["evaluate", str(out / "best"), "--out", "runs/new"]
    )
    assert main([*argv, "--data", "mydat"]) == 2
    err = capsys.readouterr().err
    assert "--data mydat: no such file or folder" in err and "cifar" not in err.lower().split("or the folder")[0]
    assert "https://" not in err and "Traceback" not in err and not (tmp_path / "runs").exists()


def test_csv_labels_with_a_separator(tmp_path, capsys):
    """Label names with spaces in a CSV: ``--label-separator`` (the default split on spaces cut them in two)."""
    names = ("red fox", "blue whale")
    (tmp_path / "img").mkdir()
    rows = []
    for i in range(16):
        (tmp_path / "img" / f"{i}.png").write_bytes(picture(names[i % 2], i))
        rows.append((f"img/{i}.png", "red fox; blue whale" if i % 4 == 0 else names[i % 2], "test" if i > 13 else ""))
    csv_path = write_csv(tmp_path, rows)
    manifest = scan(csv_path, ";")
    assert manifest.labels == ("blue whale", "red fox") and manifest.splits["train"][0].labels == names
    assert "fox;" in scan(csv_path).labels  # without it: words
    summary = train(
        config(csv_path, tmp_path / "ml", model="multimnist-matrix-small", epochs=1, val_size=2, label_separator=";")
    )
    assert capserve.read_config(tmp_path / "ml" / "best").labels == ("blue whale", "red fox") and summary
    assert (
        main(
            [
                "evaluate",
                str(tmp_path / "ml" / "best"),
                "--data",
                str(csv_path),
                "--label-separator",
                ";",
                "--iterations",
                "2",
                "--json",
            ]
        )
        == 0
    )
    assert list(json.loads(capsys.readouterr().out)["results"]["2"]["f1"]) == ["blue whale", "red fox"]
    with pytest.raises(DataError, match="--label-separator is for a CSV"):
        scan(tmp_path / "img", ";")


def test_multi_label_csv_trains_calibrates_and_evaluates(tmp_path, capsys):
    csv_path = multi_label_csv(tmp_path / "csv")
    summary = train(config(csv_path, tmp_path / "ml", model="multimnist-matrix-small", epochs=2))  # any config
    c = capserve.read_config(tmp_path / "ml" / "best")
    assert c.task == "multi_label" and c.labels == ("blue", "green", "red")
    assert c.thresholds is not None and summary["thresholds"] == list(c.thresholds)  # calibrated on val
    assert (
        main(["evaluate", str(tmp_path / "ml" / "best"), "--data", str(csv_path), "--iterations", "2", "--json"]) == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["images"] == 6 and set(report["results"]["2"]) == {"exact_match", "f1", "macro_f1", "ranked_recall"}


def test_fine_tuning_keeps_the_class_capsules_of_matching_labels(run, caplog):
    """One label of the data new (or renamed): the other labels keep what they learnt, wherever they now sit.
    The whole class layer started afresh before (CIFAR-10 at 64x64 with one label renamed: 82.6 % vs 89.2 %)."""
    out, _ = run
    source = capserve.load(out / "best").state_dict()
    weight = f"capsules.{len(capserve.load(out / 'best').capsules) - 1}.weight"  # (N, J, X, Y): J the classes
    kw = dict(
        **tiny_overrides("cifar10-simple"), image_size=SIZE, class_norm=capserve.read_config(out / "best").class_norm
    )
    target = capserve.create_model("cifar10-simple", **kw, labels=("blue whale", "red fox", "zebra"))
    fresh = target.state_dict()[weight].clone()
    with caplog.at_level(logging.INFO):
        report = init_from(target, out / "best")
    assert report["kept_labels"] == ["blue whale", "red fox"] and report["new_labels"] == ["zebra"]
    assert weight in report["partial"] and not any(k.startswith(weight.rsplit(".", 1)[0]) for k in report["new"])
    got = target.state_dict()[weight]
    for j, label in enumerate(("blue whale", "red fox")):
        assert torch.equal(got[:, j], source[weight][:, LABELS.index(label)])
    assert torch.equal(got[:, 2], fresh[:, 2])  # the new label starts afresh
    assert "1 start afresh (zebra)" in caplog.text

    renamed = capserve.create_model("cifar10-simple", **kw, labels=("blue whale", "fox", "grüne Wiese"))
    report = init_from(renamed, out / "best", {"red fox": "fox"})
    assert report["new_labels"] == [] and report["kept_labels"] == ["blue whale", "fox", "grüne Wiese"]
    got = renamed.state_dict()[weight]
    for j, old in enumerate(("blue whale", "red fox", "grüne Wiese")):  # the renamed class moved: 2 → 1
        assert torch.equal(got[:, j], source[weight][:, LABELS.index(old)])
    without = capserve.create_model("cifar10-simple", **kw, labels=("blue whale", "fox", "grüne Wiese"))
    assert init_from(without, out / "best")["new_labels"] == ["fox"]
    for bad, message in [
        ({"red wolf": "fox"}, "'red wolf' is not a label of"),
        ({"red fox": "wolf"}, "'wolf' is not a label of your data"),
        ({"red fox": "blue whale"}, "two classes"),
    ]:
        with pytest.raises(ValueError, match=message):
            init_from(
                capserve.create_model("cifar10-simple", **kw, labels=("blue whale", "fox", "grüne Wiese")),
                out / "best",
                bad,
            )


def test_label_map_on_the_command_line(run, tmp_path, capsys):
    out, _ = run
    data = write_folder(tmp_path / "renamed", train=4)
    (data / "red fox").rename(data / "fox")
    code = main(
        [
            "train",
            "--init",
            str(out / "best"),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "ft"),
            "--label-map",
            "red fox=fox",
            "--epochs",
            "1",
            "--batch-size",
            "4",
            "--val-size",
            "3",
            "--no-test",
            "--name",
            "foxes",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["init"]["new_labels"] == [] and "fox" in summary["init"]["kept_labels"]
    assert ModelMetadata.from_config(capserve.read_config(tmp_path / "ft" / "best")).name == "foxes"
    assert (
        main(
            [
                "train",
                "--model",
                "cifar10-simple",
                "--data",
                str(data),
                "--out",
                str(tmp_path / "x"),
                "--label-map",
                "a=b",
            ]
        )
        == 2
    )
    assert "give --init MODEL_DIR too" in capsys.readouterr().err


def test_fine_tuning_loads_matching_tensors(run, tmp_path):
    out, _ = run
    source = capserve.load(out / "best")
    other = capserve.create_model(
        "cifar10-simple", **tiny_overrides("cifar10-simple"), image_size=SIZE, labels=("cat", "dog")
    )
    report = init_from(other, out / "best")
    class_layer = f"capsules.{len(other.capsules) - 1}."
    assert report["new"] and all(k.startswith(class_layer) for k in report["new"])  # two labels, not three
    for name in report["loaded"]:
        assert torch.equal(other.state_dict()[name], source.state_dict()[name])
    relabelled = capserve.create_model(
        "cifar10-simple", **tiny_overrides("cifar10-simple"), image_size=SIZE, labels=("a", "b", "c")
    )
    same_shapes = init_from(relabelled, out / "best")  # same shapes, other labels: the class layer starts afresh
    assert any(k.startswith(class_layer) for k in same_shapes["new"])
    two = write_folder(tmp_path / "two", train=4)
    for p in (two / LABELS[2]).rglob("*.*"):
        p.unlink()
    code = main(
        [
            "train",
            "--init",
            str(out / "best"),
            "--data",
            str(two),
            "--out",
            str(tmp_path / "ft"),
            "--epochs",
            "1",
            "--batch-size",
            "4",
            "--val-size",
            "2",
            "--no-test",
        ]
    )
    assert code == 0
    tuned = capserve.read_config(tmp_path / "ft" / "best")
    assert tuned.labels == LABELS[:2] and tuned.image_size == SIZE and tuned.backbone_channels == 8  # --init's model


# ------------------------------------------------------------------------------------------------ serving


@pytest.mark.slow
def test_served_model_answers_with_the_users_labels(run, folder, tmp_path):

    out, _ = run
    best = out / "best"
    assert main(["export", "onnx", str(best), "-o", str(best / "model.onnx")]) == 0  # as the README says
    proc, url, log = start_server(tmp_path, CAPSERVE_MODEL=str(best), CAPSERVE_MULTILABEL_MODEL="none")
    try:
        wait_ready(proc, url, log)
        picture_file = sorted((folder / "test" / "red fox").glob("*.png"))[0]
        with open(picture_file, "rb") as f:
            r = httpx.post(
                f"{url}/classify", files={"image": (picture_file.name, f, "image/png")}, data={"top_k": "3"}, timeout=60
            )
        assert r.status_code == 200, r.text
        predictions = r.json()["predictions"]
        assert sorted(p["label"] for p in predictions) == sorted(LABELS)
        # the service's probabilities are those of the trained model on the same preprocessing
        x = preprocess(picture_file.read_bytes(), capserve.read_config(best))
        with torch.inference_mode():
            probs = torch.softmax(capserve.load(best)(torch.from_numpy(x)), dim=1)[0]
        for p in predictions:
            assert p["probability"] == pytest.approx(float(probs[LABELS.index(p["label"])]), abs=1e-4)
    finally:
        stop(proc)


def test_bench_data_refuses_fewer_images_than_its_validation_carve(tmp_path: Path) -> None:
    """benchmarks/bench_data.py holds 500 images out for validation: asking for fewer stops at once with a usage
    line (exit 2), not a ValueError traceback after writing the PNGs and building the cache."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_data.py"
    done = subprocess.run(
        [sys.executable, str(script), "--cifar", str(tmp_path), "--images", "200"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "--images must be more than 500" in done.stderr
    assert "Traceback" not in done.stderr


# ------------------------------------------------------------------------------------------------ audit holes


@pytest.mark.parametrize("kind", ["folder", "csv"])
def test_validation_carve_never_leaks_and_keeps_every_image(tmp_path, kind):
    from capserve.data.own import with_validation

    if kind == "folder":
        manifest = scan(write_folder(tmp_path / "f", train=7))
    else:
        rows = [(f"img/{i}.png", LABELS[i % 3].split()[0], "") for i in range(23)]
        manifest = scan(write_csv(tmp_path / "c", rows, header="image,labels,split"))
    before = [s.path for s in manifest.splits["train"]]
    carved, count = with_validation(manifest, 0.25)
    train_paths = [s.path for s in carved.splits["train"]]
    val_paths = [s.path for s in carved.splits["val"]]
    assert count == len(val_paths) == round(0.25 * len(before)) and count > 0
    assert not set(train_paths) & set(val_paths)  # no file in both
    assert sorted(train_paths + val_paths) == sorted(before)  # together exactly the input, each once


@pytest.mark.parametrize("raw", ["img/../../up.png", "./../up.png", "a/b/../../../up.png"])
def test_csv_paths_that_escape_after_normalising_are_refused(tmp_path, capsys, raw):
    csv_path = write_csv(tmp_path / "d", [("ok.png", "a", "train"), (raw, "b", "train")])
    code = main(["train", "--model", "cifar10-simple", "--data", str(csv_path), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and f"line 3: image path {raw!r} leaves" in err and "Traceback" not in err, err


def test_csv_paths_inside_the_folder_are_kept(tmp_path):
    (tmp_path / "d" / "img").mkdir(parents=True)
    csv_path = write_csv(tmp_path / "d", [("img/../ok.png", "a", "train"), ("img/./x/../b.png", "b", "train")])
    paths = [s.path for s in scan(csv_path).splits["train"]]
    assert paths == [tmp_path / "d" / "ok.png", tmp_path / "d" / "img" / "b.png"]


def test_precision_and_recall_are_not_swapped():
    from capserve.evaluate import single_label_metrics

    # truth 0 0 0 1, predicted 0 1 1 1: label 0 is always right when predicted (precision 1) but found once in three
    # (recall 1/3); label 1 is found every time (recall 1) but right once in three predictions (precision 1/3)
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [0.0, 2.0], [0.0, 2.0]])
    m = single_label_metrics(logits, torch.tensor([0, 0, 0, 1]))
    assert m["precision"] == pytest.approx([1.0, 1 / 3]) and m["recall"] == pytest.approx([1 / 3, 1.0])
    assert m["f1"] == pytest.approx([0.5, 0.5]) and m["support"] == [3, 1] and m["top1"] == 0.5
    assert m["confusion"] == [[1, 2], [0, 1]]  # rows true, columns predicted


def test_init_skips_tensors_of_another_shape_even_with_as_many_values(tmp_path):
    from capserve.model.checkpoint import save_model

    tiny = {**tiny_overrides("cifar10-simple"), "image_size": SIZE, "labels": LABELS}
    torch.manual_seed(1)
    source = capserve.create_model("cifar10-simple", **tiny)
    save_model(source, tmp_path / "source")
    # twice the backbone channels, half the primary types: primary.conv.weight (64, 8, 1, 1) becomes (32, 16, 1, 1),
    # the same number of values in another shape
    torch.manual_seed(2)
    target = capserve.create_model("cifar10-simple", **{**tiny, "backbone_channels": 16, "primary_types": 2})
    fresh = {k: v.clone() for k, v in target.state_dict().items()}
    report = init_from(target, tmp_path / "source")
    ours, theirs = target.state_dict(), source.state_dict()
    mismatched = sorted(k for k in ours if k in theirs and ours[k].shape != theirs[k].shape)
    assert (
        "primary.conv.weight" in mismatched
        and ours["primary.conv.weight"].numel() == theirs["primary.conv.weight"].numel()
    )
    assert set(mismatched) <= set(report["new"])  # listed as new, left as initialised
    for name in report["new"]:
        assert torch.equal(ours[name], fresh[name])
    assert report["loaded"] and not set(report["loaded"]) & set(mismatched)
    for name in report["loaded"]:  # the rest is the source's
        assert torch.equal(ours[name], theirs[name])
    assert any(k.startswith(f"capsules.{len(target.capsules) - 1}.") for k in report["loaded"])  # same labels


def test_fine_tuning_moves_a_joint_class_norm_with_its_labels(tmp_path):
    """The own-images model's class capsules share one LayerNorm with an affine per class (``class_norm="joint"``):
    a fine-tune keeps each kept label's slice wherever the label now sits, and a new label starts afresh."""
    from capserve.model.checkpoint import save_model

    tiny = {**tiny_overrides("cifar10-conv"), "image_size": SIZE, "class_norm": "joint"}
    torch.manual_seed(1)
    source = capserve.create_model("cifar10-conv", **tiny, labels=LABELS)
    norm = f"capsules.{len(source.capsules) - 1}.norm"
    with torch.no_grad():  # trained affines differ per class
        for p in (source.capsules[-1].norm.weight, source.capsules[-1].norm.bias):
            p.copy_(torch.randn_like(p))
    save_model(source, tmp_path / "source")
    target = capserve.create_model("cifar10-conv", **tiny, labels=("red fox", "blue whale", "zebra"))
    fresh = {k: v.clone() for k, v in target.state_dict().items()}
    report = init_from(target, tmp_path / "source")
    assert {f"{norm}.weight", f"{norm}.bias"} <= set(report["partial"])
    ours, theirs = target.state_dict(), source.state_dict()
    for leaf in ("weight", "bias"):
        name = f"{norm}.{leaf}"  # (J, D)
        assert torch.equal(ours[name][0], theirs[name][LABELS.index("red fox")])
        assert torch.equal(ours[name][1], theirs[name][LABELS.index("blue whale")])
        assert torch.equal(ours[name][2], fresh[name][2])
