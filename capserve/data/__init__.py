"""Data: the built-in datasets (CIFAR-10/100, MNIST, DiverseMultiMNIST), a user's own folders and CSVs, image
decoding and normalisation, and augmentation. Everything is uint8 tensors in memory; ``normalize`` makes the
network's input."""

from __future__ import annotations

from capserve.data.augment import epoch_generator, random_crop_flip  # noqa: F401
from capserve.data.builtin import (  # noqa: F401
    CIFAR10_URL,
    CIFAR100_URL,
    DATASETS,
    MNIST_URL,
    MULTIMNIST_TEST_SIZE,
    PACK_FILE,
    Data,
    dataset_for,
    has_builtin_files,
    load_cifar10,
    load_cifar100,
    load_mnist,
    load_pack,
    load_test,
    load_training,
    load_validation,
    pack_cifar,
    read_idx,
)
from capserve.data.images import (  # noqa: F401
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_SIDE,
    WHITE,
    EmptyImageError,
    ImageError,
    ImageTooLargeError,
    ImageTooSmallError,
    InputSpec,
    UndecodableImageError,
    UnsupportedImageError,
    decode_image,
    image_to_array,
    load_image,
    preprocess,
    resize_center,
    to_channels,
)
from capserve.data.multimnist import CANVAS, MAX_SHIFT, multimnist  # noqa: F401
from capserve.data.own import (  # noqa: F401
    CACHE_FILE,
    CACHE_FORMAT,
    IMAGE_SUFFIXES,
    MAX_FAILED_FRACTION,
    MAX_PIXELS,
    REQUIRED_COLUMNS,
    SHOWN_FAILURES,
    SPLITS,
    VAL_SEED,
    FailureLog,
    InputSize,
    Manifest,
    OwnData,
    Sample,
    build_cache,
    carve,
    check_labels,
    check_training,
    decode_split,
    fingerprint,
    is_own_data,
    iter_decoded,
    scan,
    scan_csv,
    scan_folder,
    targets_for,
    with_validation,
)
from capserve.data.preprocess import normalize, normalize_images, normalize_numpy  # noqa: F401
from capserve.data.progress import progress_bar  # noqa: F401
from capserve.data.splits import Split, parse_val_size, resolve_val_size  # noqa: F401
