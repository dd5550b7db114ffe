"""Write a small demo of "your own images": a label-folder tree and a multi-label CSV of drawn shapes.

    python scripts/make_demo_images.py demo

makes ``demo/shapes/{train,test}/<label>/*.png|jpg`` (labels "circle", "square", "up triangle"; one dark shape
per picture on a light background, random colours, sizes and positions; some grayscale, RGBA and JPEG files) and
``demo/multi/labels.csv`` (columns image,labels,split; one to three shapes per picture in ``demo/multi/images/``).
Seeded: the same files every time. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "up triangle")


def draw(canvas: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], colour: tuple[int, ...]) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        canvas.ellipse(box, fill=colour)
    elif shape == "square":
        canvas.rectangle(box, fill=colour)
    else:
        canvas.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=colour)


def picture(rng: np.random.Generator, shapes: list[str], side: int = 48) -> Image.Image:
    """Dark shapes side by side (one per slot) on a light background of random tint, with a little noise."""
    background = tuple(int(v) for v in rng.integers(170, 256, 3))
    image = Image.new("RGB", (side, side), background)
    canvas = ImageDraw.Draw(image)
    slot = side // len(shapes)
    for i, shape in enumerate(shapes):
        size = int(rng.integers(max(10, slot * 2 // 3), slot + 1))
        x0 = i * slot + int(rng.integers(0, slot - size + 1))
        y0 = int(rng.integers(0, side - size + 1))
        colour = tuple(int(v) for v in rng.integers(0, 110, 3))
        draw(canvas, shape, (x0, y0, x0 + size - 1, y0 + size - 1), colour)
    noise = rng.integers(-10, 11, (side, side, 3))
    return Image.fromarray(np.clip(np.asarray(image, dtype=np.int64) + noise, 0, 255).astype(np.uint8))


def save(image: Image.Image, path: Path, i: int) -> Path:
    """Every few files in another mode or format, as real photo folders are."""
    if i % 7 == 3:
        image = image.convert("L")
    elif i % 7 == 5:
        image = image.convert("RGBA")
    path = path.with_suffix(".jpg" if i % 5 == 2 and image.mode != "RGBA" else ".png")
    image.save(path, **({"quality": 92} if path.suffix == ".jpg" else {}))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="folder to write (created)")
    p.add_argument("--per-label", type=int, default=120, help="training pictures per label (test: a quarter)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out = Path(args.out)
    rng = np.random.default_rng(args.seed)
    for split, n in (("train", args.per_label), ("test", max(1, args.per_label // 4))):
        for shape in SHAPES:
            folder = out / "shapes" / split / shape
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                save(picture(rng, [shape]), folder / f"{i:04d}", i)
    images = out / "multi" / "images"
    images.mkdir(parents=True, exist_ok=True)
    words = {"circle": "circle", "square": "square", "up triangle": "triangle"}  # CSV labels are single words
    with open(out / "multi" / "labels.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["image", "labels", "split"])
        for i in range(len(SHAPES) * args.per_label):
            shapes = sorted(rng.choice(SHAPES, size=int(rng.integers(1, 4)), replace=False).tolist())
            order = [str(s) for s in rng.permutation(shapes)]
            path = save(picture(rng, order), images / f"{i:05d}", i)
            split = "test" if i % 10 == 9 else "val" if i % 10 == 8 else "train"
            writer.writerow([path.relative_to(out / "multi").as_posix(), " ".join(words[s] for s in shapes), split])
    print(f"wrote {out / 'shapes'} (train/ and test/, labels: {', '.join(SHAPES)}) and {out / 'multi' / 'labels.csv'}")


if __name__ == "__main__":
    main()
