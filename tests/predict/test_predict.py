"""``capserve predict`` and ``Predictor``: the service's answers offline, for every kind of source, bad files as
rows, a killed run resumed with exactly one row per image, and the Ray Data recipe of docs/predict.md."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.inprocess import in_process_service
from support.models import tiny_model
from support.server import export, random_png

from capserve.cli import main
from capserve.predict import Predictor
from capserve.predict.inputs import expand

ROOT = Path(__file__).resolve().parents[2]
CIFAR10, MULTIMNIST = str(ROOT / "models" / "cifar10"), str(ROOT / "models" / "multimnist")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Images in nested folders, of several formats and sizes, one file that is not an image, a hidden file and two
    hidden folders with images in them."""
    root = tmp_path_factory.mktemp("images")
    (root / "b" / "deep").mkdir(parents=True)
    (root / "a").mkdir()
    for i in range(5):
        (root / "a" / f"{i}.png").write_bytes(random_png(i, (40 + i, 32)))
    Image.open(io.BytesIO(random_png(9, (64, 48)))).save(root / "b" / "photo.jpg", quality=90)
    (root / "b" / "deep" / "grey.png").write_bytes(random_png(10, (32, 32), "L"))
    (root / "b" / "broken.png").write_bytes(b"\x89PNG not really")
    (root / "b" / ".hidden.png").write_bytes(random_png(11))
    for hidden in (".ipynb_checkpoints", "b/.thumbnails"):  # what notebooks and file managers leave beside images
        (root / hidden).mkdir()
        (root / hidden / "0.png").write_bytes(random_png(12))
    (root / "b" / "notes.txt").write_text("not an image")
    return root


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sources_in_order_folders_globs_manifests_and_stdin(folder, tmp_path):
    listed = list(expand([str(folder)]))
    assert [Path(p).relative_to(folder).as_posix() for p in listed] == [
        "a/0.png",
        "a/1.png",
        "a/2.png",
        "a/3.png",
        "a/4.png",
        "b/broken.png",
        "b/photo.jpg",
        "b/deep/grey.png",
    ]
    manifest = tmp_path / "list.csv"
    manifest.write_text("image,labels\na/3.png,x\n" + f"{folder / 'a' / '1.png'},y\n")
    (tmp_path / "a").symlink_to(folder / "a")
    got = list(
        expand(
            [str(folder / "a" / "4.png"), str(folder / "a" / "[02].png"), str(manifest), "-"],
            stdin=io.StringIO(f"{folder / 'b' / 'photo.jpg'}\n\n"),
        )
    )
    assert [Path(p).name for p in got] == ["4.png", "0.png", "2.png", "3.png", "1.png", "photo.jpg"]
    with pytest.raises(Exception, match="matches no file"):
        list(expand([str(folder / "*.gif")]))


def test_answers_are_the_services_own(folder, tmp_path, capsys):
    """Every row is the JSON body /classify or /multilabel gives for the same file (batching off on both sides)."""
    out_c, out_m = tmp_path / "c.jsonl", tmp_path / "m.jsonl"
    assert main(["predict", CIFAR10, str(folder), "--out", str(out_c), "--batch-size", "1", "--top-k", "3"]) == 0
    assert (
        main(["predict", MULTIMNIST, str(folder), "--out", str(out_m), "--batch-size", "1", "--threshold", "0.3"]) == 0
    )
    with in_process_service(
        tmp_path, CAPSERVE_MODEL=CIFAR10, CAPSERVE_MULTILABEL_MODEL=MULTIMNIST, CAPSERVE_MAX_BATCH_SIZE="1"
    ) as client:
        for route, out, params in (("/classify", out_c, {"top_k": "3"}), ("/multilabel", out_m, {"threshold": "0.3"})):
            for row in rows(out):
                path = Path(row.pop("path"))
                served = client.post(route, files={"image": (path.name, path.read_bytes(), "image/png")}, data=params)
                body = served.json()
                if "error" in row:
                    assert served.status_code == 400 and body == {"error": row["error"]}, path
                else:
                    assert served.status_code == 200 and body == row, path


def test_a_batch_answers_as_single_images_do(folder, tmp_path):
    one, many = tmp_path / "one.jsonl", tmp_path / "many.jsonl"
    assert main(["predict", CIFAR10, str(folder), "--out", str(one), "--batch-size", "1"]) == 0
    assert main(["predict", CIFAR10, str(folder), "--out", str(many), "--batch-size", "64", "--workers", "3"]) == 0
    for a, b in zip(rows(one), rows(many), strict=True):
        assert a["path"] == b["path"] and a.get("error") == b.get("error")
        if "error" not in a:
            assert [p["label"] for p in a["predictions"]] == [p["label"] for p in b["predictions"]]
            np.testing.assert_allclose(
                [p["probability"] for p in a["predictions"]], [p["probability"] for p in b["predictions"]], atol=1e-5
            )


def test_bad_files_are_rows_and_the_exit_status_counts_them(folder, tmp_path, capsys):
    out = tmp_path / "out.csv"
    assert main(["predict", CIFAR10, str(folder), "--out", str(out)]) == 0
    table = list(csv.DictReader(out.open()))
    assert len(table) == 8 and [r["path"] for r in table] == list(expand([str(folder)]))
    broken = next(r for r in table if r["path"].endswith("broken.png"))
    assert broken["error"].startswith("the image: ") and not broken["answer"]
    good = next(r for r in table if r["path"].endswith("photo.jpg"))
    answer = json.loads(good["answer"])
    assert answer["predictions"][0]["label"] == good["label"]
    # the shipped model's calibration: each row says how unfamiliar its image is, as the server's answer does
    assert float(good["unfamiliarity"]) == pytest.approx(answer["unfamiliarity"], rel=1e-5)
    assert good["unfamiliar"] == ("true" if answer["unfamiliar"] else "false")
    assert broken["unfamiliarity"] == broken["unfamiliar"] == ""
    assert "8 images, 1 failed" in capsys.readouterr().err
    # one bad file in eight is more than a 10 % allowance; a run of bad files alone answers nothing
    assert main(["predict", CIFAR10, str(folder), "--out", str(tmp_path / "x.csv"), "--max-failures", "0.1"]) == 1
    assert main(["predict", CIFAR10, str(folder / "b" / "broken.png")]) == 1
    assert "no image could be answered" in capsys.readouterr().err
    assert main(["predict", CIFAR10, str(folder), "--out", str(out)]) == 2  # exists: --resume or another file
    assert main(["predict", CIFAR10, str(tmp_path / "nothing-here")]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_a_run_that_finds_no_image_leaves_no_out_file(folder, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["predict", CIFAR10, "-", "--out", str(out)]) == 1  # a list that names no image
    assert "the sources hold no image" in capsys.readouterr().err
    assert not out.exists()
    assert main(["predict", CIFAR10, str(folder / "a"), "--out", str(out)]) == 0  # the corrected run is not refused
    assert main(["predict", CIFAR10, str(folder / "a"), "--out", str(out), "--resume"]) == 0  # nothing left to answer
    assert len(rows(out)) == 5


def test_resume_after_a_cut_row_gives_each_image_one_row(folder, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert main(["predict", CIFAR10, str(folder), "--out", str(out)]) == 0
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:3]) + lines[3][:25])  # a kill in the middle of the fourth row
    assert main(["predict", CIFAR10, str(folder), "--out", str(out), "--resume"]) == 0
    assert [r["path"] for r in rows(out)] == list(expand([str(folder)]))
    assert "(3 skipped: already in" in capsys.readouterr().err


def test_a_killed_run_resumed_loses_nothing_and_repeats_nothing(tmp_path):
    """SIGKILL while ``capserve predict`` writes, then --resume: every image has exactly one row."""
    images = tmp_path / "many"
    images.mkdir()
    for i in range(240):
        (images / f"{i:04d}.png").write_bytes(random_png(i % 7, (32, 32)))
    out = tmp_path / "out.csv"
    cmd = [
        sys.executable,
        "-m",
        "capserve.cli",
        "predict",
        CIFAR10,
        str(images),
        "--out",
        str(out),
        "--batch-size",
        "8",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not out.exists() or out.read_text().count("\n") < 40):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    written = out.read_text().count("\n") - 1
    assert 0 < written < 240, written  # killed part-way
    subprocess.run([*cmd, "--resume"], env=env, check=True, capture_output=True, timeout=300)
    paths = [r["path"] for r in csv.DictReader(out.open())]
    assert sorted(paths) == sorted(str(p) for p in images.iterdir()) and len(paths) == 240


def test_the_python_api_takes_paths_bytes_pil_images_and_arrays(folder):
    predictor = Predictor(CIFAR10, top_k=2)
    path = folder / "b" / "photo.jpg"
    data = path.read_bytes()
    image = Image.open(io.BytesIO(data))
    by_path, by_bytes, by_pil, by_array = predictor.predict([path, data, image, np.asarray(image.convert("RGB"))])
    assert by_path == by_bytes == by_pil == by_array and len(by_path["predictions"]) == 2
    assert predictor.predict([b"nope"])[0]["error"].startswith("the image: ")
    with pytest.raises(ValueError, match="top_k=11"):
        Predictor(CIFAR10, top_k=11)


@pytest.mark.parametrize("column", ["path", "image"])
def test_a_ray_batch_keeps_its_paths_beside_the_answers(folder, column):
    """``Predictor.__call__`` as Ray Data's ``map_batches`` calls it, without Ray: a dict of columns in, the same
    rows out in order, with ``path`` kept when the batch had one (the recipe's CSV joins answers to files by it)."""
    paths = [str(folder / "a" / "0.png"), str(folder / "b" / "broken.png"), str(folder / "b" / "photo.jpg")]
    predictor = Predictor(CIFAR10, top_k=1)
    if column == "path":
        batch = {"path": np.asarray(paths, dtype=object)}
    else:  # read_images' column: decoded arrays, no path
        batch = {"image": np.stack([np.asarray(Image.open(p).convert("RGB").resize((32, 32))) for p in paths[::2]])}
    out = predictor(batch)
    rows = len(batch[column])
    assert set(out) == ({"path", "answer", "error"} if column == "path" else {"answer", "error"})
    assert all(len(values) == rows for values in out.values())
    if column == "path":
        assert list(out["path"]) == paths
        assert out["error"][1].startswith("the image: ") and out["answer"][1] == ""
        local = predictor.predict(paths)
        assert [json.loads(a) if a else None for a in out["answer"]] == [None if "error" in r else r for r in local]
    else:
        assert not any(out["error"]) and all(json.loads(a)["predictions"] for a in out["answer"])


def test_the_ray_data_recipe(folder, tmp_path, monkeypatch):
    """docs/predict.md's recipe on a local Ray instance: a data set of paths → map_batches(Predictor) → CSV."""
    ray = pytest.importorskip("ray", reason="pip install 'capserve[ray]' (Ray Data) to run the Ray recipe")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")  # Ray reports usage to its makers unless told not to
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        paths = sorted(str(p) for p in (folder / "a").iterdir()) * 6  # 30 images
        ds = ray.data.from_items([{"path": p} for p in paths])
        answered = ds.map_batches(
            Predictor, fn_constructor_kwargs={"model": CIFAR10, "top_k": 1}, batch_size=8, concurrency=1
        )
        answered.write_csv(str(tmp_path / "ray-out"))
        table = [r for f in sorted((tmp_path / "ray-out").glob("*.csv")) for r in csv.DictReader(f.open())]
    finally:
        ray.shutdown()
    local = {p: r for p, r in zip(paths, Predictor(CIFAR10, top_k=1).predict(paths), strict=True)}
    assert len(table) == 30
    for row in table:
        assert not row["error"] and json.loads(row["answer"]) == local[row["path"]]


@pytest.fixture(scope="module", params=[2, 3], ids=["2-labels", "3-labels"])
def small_models(request, tmp_path_factory) -> tuple[tuple[str, ...], Path, Path]:
    """(labels, a single-label model folder, a multi-label one), with 2 or 3 labels: fewer than the default 5."""
    labels = ("circle", "square", "triangle")[: request.param]
    tmp = tmp_path_factory.mktemp(f"labels{request.param}")
    single = export(tiny_model("cifar10-simple", labels=labels), tmp / "single", explain=False)
    multi = export(tiny_model("multimnist-matrix-small", labels=labels), tmp / "multi", explain=False)
    return labels, single, multi


def test_a_model_with_fewer_than_five_labels_answers_the_default_question(small_models, folder, tmp_path, capsys):
    """No --top-k: up to 5 labels, so all of a 2- or 3-label model's; a multi-label model is never refused for a
    top_k it does not use; an explicit --top-k above the labels is a clear error (exit 2), in the server's words."""
    labels, single, multi = small_models
    image = str(folder / "a" / "0.png")
    out = tmp_path / "single.jsonl"
    assert main(["predict", str(single), image, "--out", str(out)]) == 0
    assert sorted(p["label"] for p in rows(out)[0]["predictions"]) == sorted(labels)
    assert len(Predictor(str(single)).predict([image])[0]["predictions"]) == len(labels)
    for top_k in ([], ["--top-k", "9"]):
        out = tmp_path / f"multi{len(top_k)}.jsonl"
        assert main(["predict", str(multi), image, "--out", str(out), *top_k]) == 0
        assert set(rows(out)[0]["probabilities"]) == set(labels)
    capsys.readouterr()
    n = len(labels)
    assert main(["predict", str(single), image, "--top-k", str(n + 1)]) == 2
    err = capsys.readouterr().err
    assert f"top_k={n + 1} but the model has {n} labels: give 1..{n}" in err and "Traceback" not in err
    with pytest.raises(ValueError, match=f"top_k={n + 1} but the model has {n} labels"):
        Predictor(str(single), top_k=n + 1)
    with pytest.raises(ValueError, match="threshold must be in"):
        Predictor(str(multi), threshold=1.0)


def test_max_failures_allows_exactly_its_fraction(folder, tmp_path, capsys):
    """One bad file of two is 50 % failed: --max-failures 0.5 allows it (more than the fraction fails, not as much)."""
    two = [str(folder / "a" / "0.png"), str(folder / "b" / "broken.png")]
    assert main(["predict", CIFAR10, *two, "--out", str(tmp_path / "half.csv"), "--max-failures", "0.5"]) == 0
    assert main(["predict", CIFAR10, *two, "--out", str(tmp_path / "less.csv"), "--max-failures", "0.49"]) == 1
    assert "50.0% of the images failed (--max-failures 0.49)" in capsys.readouterr().err


# capserve predict in a process that is killed (SIGKILL, nothing flushed on the way out) as its second batch starts
KILLED_AT_THE_SECOND_BATCH = """
import os, signal, sys
from capserve.cli import main
from capserve.predict.predictor import Predictor
answer, calls = Predictor.answer, []
def answer_then_die(self, pixels):
    calls.append(len(pixels))
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return answer(self, pixels)
Predictor.answer = answer_then_die
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_each_batch_is_on_disk_before_the_next_is_answered(folder, tmp_path, suffix):
    """The rows of every answered batch are flushed before the next batch runs, so a kill keeps all of them."""
    paths = list(expand([str(folder / "a")]))  # 5 images: batches of 2, 2 and 1
    out = tmp_path / f"out{suffix}"
    command = [sys.executable, "-c", KILLED_AT_THE_SECOND_BATCH, "predict", CIFAR10, *paths, "--out", str(out)]
    result = subprocess.run(
        [*command, "--batch-size", "2"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    kept = [r["path"] for r in csv.DictReader(out.open())] if suffix == ".csv" else [r["path"] for r in rows(out)]
    assert kept == paths[:2]


def test_a_manifest_names_images_relative_to_its_own_folder(folder, tmp_path, monkeypatch):
    """A CSV's relative ``image`` paths are read from the CSV's folder, never from the working directory, even where
    the working directory holds a different image under the same name."""
    listed = tmp_path / "listed"
    (listed / "pics").mkdir(parents=True)
    (listed / "pics" / "x.png").write_bytes(random_png(20))
    (listed / "list.csv").write_text("image,labels\npics/x.png,cat\n")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "pics").mkdir(parents=True)
    (elsewhere / "pics" / "x.png").write_bytes(random_png(21, (40, 40)))
    monkeypatch.chdir(elsewhere)
    assert list(expand([str(listed / "list.csv")])) == [str(listed / "pics" / "x.png")]
    out = tmp_path / "out.jsonl"
    assert main(["predict", CIFAR10, str(listed / "list.csv"), "--out", str(out)]) == 0
    (row,) = rows(out)
    assert row.pop("path") == str(listed / "pics" / "x.png")
    predictor = Predictor(CIFAR10)
    assert (
        row == predictor.predict([listed / "pics" / "x.png"])[0] != predictor.predict([elsewhere / "pics" / "x.png"])[0]
    )
