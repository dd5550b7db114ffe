"""Data: the built-in datasets (CIFAR-10/100, MNIST, DiverseMultiMNIST), a user's own folders and CSVs, image
decoding and normalisation, and augmentation. Everything is uint8 tensors in memory; ``normalize`` makes the
network's input. The modules: ``builtin``, ``own``, ``cache``, ``images``, ``preprocess``, ``augment``,
``splits``."""

from __future__ import annotations

from capserve.data.builtin import load_test, load_training, load_validation
from capserve.data.images import ImageError, InputSpec, load_image
from capserve.data.own import scan
from capserve.data.preprocess import normalize, normalize_images
from capserve.data.splits import Split

__all__ = [
    "ImageError",
    "InputSpec",
    "Split",
    "load_image",
    "load_test",
    "load_training",
    "load_validation",
    "normalize",
    "normalize_images",
    "scan",
]
