"""How well the unfamiliarity score (``capserve.runtime.familiarity``) tells images a model learned from from images
it never saw, beside the two standard post-hoc baselines computed from the same logits: the maximum softmax
probability (MSP, Hendrycks & Gimpel 2017) and the energy score (Liu et al. 2020). Prints, per unfamiliar set, AUROC
(familiar against unfamiliar) and FPR at 95 % TPR (the share of unfamiliar images a threshold keeping 95 % of
familiar ones calls familiar), with the CPU. Asserts nothing.

Far-unfamiliar sets, built here from what the machine has: MNIST digits (grey, resized to 32×32), uniform noise,
procedural textures (stripes and waves with noise), drawn pictograms (shapes on plain backgrounds) and coloured
letters. The familiar set: CIFAR-10 test images the model never trained on. The scores come from the served path:
ONNX Runtime on the model folder's ``model.onnx`` and its ``familiarity.safetensors``.

``--candidates``: the scores a capsule network could compute, compared on the eager model: KNN (k = 10, 50) and
Mahalanobis distance on the logits, the class capsules and the last grid capsule layer's poses averaged over its
grid; the served score is Mahalanobis on the class capsules.

``--near``: near-unfamiliar, classes held out of the same data: a ``cifar10-conv`` model trained with ``capserve
train``'s own-data defaults on CIFAR-10 pictures of six classes (calibrated as every run is), against the test
pictures of the four classes it never saw, and the far sets.

    python benchmarks/bench_unfamiliar.py --cifar10 DATA/cifar10 --mnist DATA/mnist [--model models/cifar10]
        [--candidates] [--near]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from capserve.data.builtin import load_cifar10, load_mnist
from capserve.data.preprocess import normalize_images
from capserve.hardware import cpu_info
from capserve.runtime import load_runtime
from capserve.runtime.familiarity import read_familiarity

ROOT = Path(__file__).resolve().parents[1]
SET_SIZE = 1000


# ------------------------------------------------------------------------------------------ the unfamiliar sets


def digits(mnist: str) -> np.ndarray:
    images, _ = load_mnist(mnist, train=False)
    grey = np.stack([np.asarray(Image.fromarray(a).resize((32, 32))) for a in images[:SET_SIZE].numpy()])
    return np.repeat(grey[:, None], 3, axis=1)  # (N, 3, 32, 32)


def noise() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (SET_SIZE, 3, 32, 32), dtype=np.uint8)


def texture(seed: int) -> np.ndarray:
    r = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:32, 0:32]
    f = r.uniform(0.2, 1.5, 2)
    wave = np.sin(f[0] * xx + f[1] * yy + r.uniform(0, 6.3)) * np.cos(r.uniform(0.1, 1) * xx * yy / 16)
    colours = r.integers(0, 256, (2, 3))
    t = (wave[..., None] + 1) / 2
    image = t * colours[0] + (1 - t) * colours[1] + r.normal(0, 12, (32, 32, 3))
    return np.clip(image, 0, 255).astype(np.uint8).transpose(2, 0, 1)


def drawn(seed: int, letters: bool) -> np.ndarray:
    r = np.random.default_rng(1000 + seed)
    background, ink = (tuple(int(v) for v in r.integers(0, 256, 3)) for _ in range(2))
    image = Image.new("RGB", (32, 32), background)
    draw = ImageDraw.Draw(image)
    if letters:
        xy = (int(r.integers(2, 16)), int(r.integers(2, 16)))
        draw.text(xy, chr(int(r.integers(65, 91))), fill=ink, font=ImageFont.load_default())
        if r.random() < 0.5:
            image = image.resize((64, 64)).crop((0, 0, 32, 32))
    else:
        for _ in range(int(r.integers(1, 4))):
            x0, y0 = (int(v) for v in r.integers(0, 24, 2))
            box = [x0, y0, x0 + int(r.integers(6, 20)), y0 + int(r.integers(6, 20))]
            kind = int(r.integers(0, 3))
            if kind == 0:
                draw.ellipse(box, fill=ink)
            elif kind == 1:
                draw.rectangle(box, fill=ink)
            else:
                draw.line(box, fill=ink, width=3)
    return np.asarray(image).transpose(2, 0, 1)


def far_sets(mnist: str) -> dict[str, np.ndarray]:
    return {
        "MNIST digits": digits(mnist),
        "noise": noise(),
        "textures": np.stack([texture(i) for i in range(SET_SIZE)]),
        "pictograms": np.stack([drawn(i, False) for i in range(SET_SIZE)]),
        "coloured letters": np.stack([drawn(i, True) for i in range(SET_SIZE)]),
    }


# ------------------------------------------------------------------------------------------ the scores


def scores(folder: Path, images: np.ndarray) -> dict[str, np.ndarray]:
    """Higher: more unfamiliar. The model's score, and MSP and energy from the same logits."""
    runtime = load_runtime(folder / "model.onnx")
    familiarity = read_familiarity(folder)
    logits, poses = runtime.infer_in_batches(normalize_images(images, runtime.metadata), 250)
    z = logits.astype(np.float64)
    top = z.max(axis=1, keepdims=True)
    log_sum = np.log(np.exp(z - top).sum(axis=1)) + top[:, 0]
    softmax_max = np.exp(top[:, 0] - log_sum)
    return {"unfamiliarity": familiarity.scores(poses), "MSP": -softmax_max, "energy": -log_sum}


def cost(folder: Path, images: np.ndarray, batch: int = 32, rounds: int = 5) -> str:
    """What the score adds to inference: ms per image of ``infer`` on batches of ``batch`` and of the score."""
    runtime = load_runtime(folder / "model.onnx")
    familiarity = read_familiarity(folder)
    x = normalize_images(images[:batch], runtime.metadata)
    _, poses = runtime.infer(x)
    infer, score = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        runtime.infer(x)
        infer.append(time.perf_counter() - start)
        start = time.perf_counter()
        familiarity.scores(poses)
        score.append(time.perf_counter() - start)
    per_image = [1000 * np.median(t) / batch for t in (infer, score)]
    return f"cost at batch {batch}: inference {per_image[0]:.3f} ms per image, the score {per_image[1]:.4f} ms"


def auroc(familiar: np.ndarray, unfamiliar: np.ndarray) -> float:
    """P(an unfamiliar image scores above a familiar one), ties counted half (Mann-Whitney U)."""
    both = np.concatenate([familiar, unfamiliar])
    order = both.argsort(kind="mergesort")
    ranks = np.empty(len(both))
    ranks[order] = np.arange(1, len(both) + 1)
    _, inverse, counts = np.unique(both, return_inverse=True, return_counts=True)
    ranks = (np.bincount(inverse, weights=ranks) / counts)[inverse]  # ties: their mean rank
    n = len(unfamiliar)
    return float((ranks[len(familiar) :].sum() - n * (n + 1) / 2) / (n * len(familiar)))


def fpr_at_95_tpr(familiar: np.ndarray, unfamiliar: np.ndarray) -> float:
    return float((unfamiliar <= np.quantile(familiar, 0.95)).mean())


def table(title: str, folder: Path, familiar_images: np.ndarray, sets: dict[str, np.ndarray]) -> None:
    base = scores(folder, familiar_images)
    methods = list(base)
    print(f"\n{title}\n")
    print("| unfamiliar set | " + " | ".join(f"{m} AUROC / FPR95" for m in methods) + " |")
    print("|---|" + "---|" * len(methods))
    rows = []
    for name, images in sets.items():
        other = scores(folder, images)
        rows.append([(auroc(base[m], other[m]), fpr_at_95_tpr(base[m], other[m])) for m in methods])
        cells = " | ".join(f"{a:.3f} / {f:.2f}" for a, f in rows[-1])
        print(f"| {name} | {cells} |", flush=True)
    mean = np.mean(rows, axis=0)
    print("| **mean** | " + " | ".join(f"**{a:.3f} / {f:.2f}**" for a, f in mean) + " |")
    print(f"familiar images called unfamiliar: {np.mean(base['unfamiliarity'] > 1):.3f}")


# ------------------------------------------------------------------------------------------ near: held-out classes


def held_out_model(cifar10: str, out: Path, per_class: int, epochs: int, keep: int = 6) -> Path:
    """A run of ``capserve train``'s own-data defaults on ``per_class`` CIFAR-10 training pictures of the first
    ``keep`` classes (a folder of PNGs), exported; returns its ``best/``."""
    from capserve.configs import CIFAR10_LABELS

    train = load_cifar10(cifar10, train=True)
    for k, label in enumerate(CIFAR10_LABELS[:keep]):
        (out / "data" / label).mkdir(parents=True)
        index = np.flatnonzero(train.targets.numpy() == k)[:per_class]
        for i in index:
            Image.fromarray(train.images[i].numpy().transpose(1, 2, 0)).save(out / "data" / label / f"{i}.png")
    capserve = str(Path(sys.executable).with_name("capserve"))
    run = out / "run"
    subprocess.run(
        [capserve, "train", "--data", str(out / "data"), "--out", str(run), "--epochs", str(epochs)], check=True
    )
    subprocess.run([capserve, "export", "onnx", str(run / "best"), "-o", str(run / "best" / "model.onnx")], check=True)
    return run / "best"


# ------------------------------------------------------------------------------------------ the candidates


def features(model, images: np.ndarray) -> dict[str, np.ndarray]:
    """What a score could read, per image: the logits, the class capsules (C·D) and the last grid capsule layer's
    poses averaged over its grid (types·D), from the eager model."""
    import torch

    from capserve.data.preprocess import normalize

    out: dict[str, list[np.ndarray]] = {"logits": [], "class capsules": [], "grid capsules": []}
    with torch.inference_mode():
        for start in range(0, len(images), 250):
            x = normalize(torch.from_numpy(images[start : start + 250]), model.config.mean, model.config.std)
            poses, _ = model.route(x, model.config.iterations, keep_coefficients=False)
            grid = poses[-2]  # (B, H, W, I, D)
            out["logits"].append(model.logits_from(poses[-1]).numpy())
            out["class capsules"].append(poses[-1].flatten(1).numpy())
            out["grid capsules"].append(grid.mean(dim=tuple(range(1, grid.ndim - 2))).flatten(1).numpy())
    return {k: np.concatenate(v) for k, v in out.items()}


def unit(a: np.ndarray) -> np.ndarray:
    return a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)


def knn(fit: np.ndarray, query: np.ndarray, k: int) -> np.ndarray:
    """Minus the cosine similarity of the k-th nearest training image (Sun et al. 2022's KNN score)."""
    return -np.sort(unit(query) @ unit(fit).T, axis=1)[:, -k]


def mahalanobis(fit: np.ndarray, labels: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Distance to the nearest class mean under the shared covariance (Lee et al. 2018), on unit-length features."""
    from capserve.runtime.familiarity import fit_familiarity

    f, q = unit(fit), unit(query)
    return fit_familiarity(f[:, None, :], labels, f[:10, None, :]).distances(q[:, None, :])


def candidates(cifar10: str, mnist: str, model_dir: str) -> None:
    """Each score a capsule network could compute, on the same images: KNN and Mahalanobis on each feature."""
    import capserve

    model = capserve.load(model_dir).eval()
    train = load_cifar10(cifar10, train=True)
    pick = np.random.default_rng(0).permutation(len(train))[:5000]
    fit, labels = features(model, train.images.numpy()[pick]), train.targets.numpy()[pick]
    familiar = features(model, load_cifar10(cifar10, train=False).images[:2000].numpy())
    sets = {name: features(model, images) for name, images in far_sets(mnist).items()}
    rows = {}
    for feature in fit:
        rows[f"Mahalanobis, {feature}"] = lambda q, f=feature: mahalanobis(fit[f], labels, q[f])
        for k in (10, 50):
            rows[f"KNN k={k}, {feature}"] = lambda q, f=feature, k=k: knn(fit[f], q[f], k)
    print("\nCandidate scores on the eager model (AUROC / FPR95; CIFAR-10 test images against each set)\n")
    print("| score | " + " | ".join(sets) + " | mean AUROC |")
    print("|---|" + "---|" * (len(sets) + 1))
    for name, score in rows.items():
        base = score(familiar)
        cells = [(auroc(base, score(q)), fpr_at_95_tpr(base, score(q))) for q in sets.values()]
        print(f"| {name} | " + " | ".join(f"{a:.3f} / {f:.2f}" for a, f in cells) + f" | {np.mean(cells, 0)[0]:.3f} |")


def main() -> None:
    print(f"# CPU: {cpu_info().describe()}", flush=True)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cifar10", required=True)
    p.add_argument("--mnist", required=True)
    p.add_argument("--model", default=str(ROOT / "models" / "cifar10"))
    p.add_argument("--near", action="store_true", help="also train a model on six classes and hold four out")
    p.add_argument("--near-images", type=int, default=200, help="training pictures a class for --near")
    p.add_argument("--near-epochs", type=int, default=6)
    p.add_argument("--candidates", action="store_true", help="also compare the scores a capsule network could use")
    args = p.parse_args()
    test = load_cifar10(args.cifar10, train=False)
    familiar = test.images[:2000].numpy()
    sets = far_sets(args.mnist)
    title = f"{args.model}: CIFAR-10 test images (2,000) against {SET_SIZE:,} of each set"
    table(title, Path(args.model), familiar, sets)
    print(cost(Path(args.model), familiar))
    if args.candidates:
        candidates(args.cifar10, args.mnist, args.model)
    if args.near:
        with tempfile.TemporaryDirectory(prefix="capserve-near-") as tmp:
            best = held_out_model(args.cifar10, Path(tmp), args.near_images, args.near_epochs)
            seen = test.targets.numpy() < 6
            near = {"the 4 held-out CIFAR-10 classes": test.images.numpy()[~seen][:2000], **sets}
            title = "cifar10-conv (own-data defaults) on 6 CIFAR-10 classes: their test images against"
            table(title, best, test.images.numpy()[seen][:2000], near)


if __name__ == "__main__":
    main()
