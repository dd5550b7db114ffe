"""Pack the training data that a remote GPU run needs into one small folder (default ``.gpu/``).

CIFAR-10's training set (154 MB as pickles) becomes JPEG mosaics (quality 93, 4:4:4 chroma: about 34 MiB,
mean absolute pixel error about 2.4/255, printed below); the MNIST training IDX files are copied as they are.
Test sets stay behind: evaluate on the original files with ``capserve evaluate``.

    python scripts/pack_gpu_data.py --data data/ --out .gpu
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from capserve.data.builtin import load_cifar10, load_mnist, load_pack, pack_cifar


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--data",
        default="data",
        help="folder with cifar-10-batches-py and MNIST/raw, any usual layout (default: %(default)s)",
    )
    p.add_argument("--out", default=".gpu")
    p.add_argument("--quality", type=int, default=93)
    p.add_argument("--subsampling", default="4:4:4")
    args = p.parse_args()
    out = Path(args.out)
    cifar = out / "cifar10"
    if cifar.exists():
        shutil.rmtree(cifar)
    train = load_cifar10(args.data, train=True)
    pack_cifar(train, cifar, "train", "cifar10", args.quality, args.subsampling)
    back = load_pack(cifar, "train")
    err = (back.images.float() - train.images.float()).abs().mean().item()
    size = sum(f.stat().st_size for f in cifar.iterdir())
    print(
        f"CIFAR-10 train: {len(back)} images, {size / 2**20:.1f} MiB, mean |error| {err:.2f}/255, "
        f"labels equal: {bool((back.targets == train.targets).all())}"
    )
    mnist = out / "mnist"
    mnist.mkdir(parents=True, exist_ok=True)
    digits, _ = load_mnist(args.data, train=True)  # validates the files before copying
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
        src = next(Path(args.data).rglob(name + ".gz"), None) or next(Path(args.data).rglob(name))
        shutil.copy(src, mnist / src.name)
    print(f"MNIST train: {len(digits)} digits copied to {mnist}")


if __name__ == "__main__":
    main()
