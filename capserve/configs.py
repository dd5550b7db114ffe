"""Model configurations as data: one frozen dataclass per model, one named table.

Only independent choices are stored; every size (feature maps, capsule counts) is derived and checked in
``__post_init__``, so a bad override fails at construction with a message that says what to change.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from capserve.records import checked_fields

CIFAR10_LABELS = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
# the CIFAR-100 fine labels in class-index order, wrapped (one per line would fill a fifth of the module)
# fmt: off
CIFAR100_LABELS = (
    "apple", "aquarium_fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle", "bowl", "boy",
    "bridge", "bus", "butterfly", "camel", "can", "castle", "caterpillar", "cattle", "chair", "chimpanzee", "clock",
    "cloud", "cockroach", "couch", "crab", "crocodile", "cup", "dinosaur", "dolphin", "elephant", "flatfish",
    "forest", "fox", "girl", "hamster", "house", "kangaroo", "keyboard", "lamp", "lawn_mower", "leopard", "lion",
    "lizard", "lobster", "man", "maple_tree", "motorcycle", "mountain", "mouse", "mushroom", "oak_tree", "orange",
    "orchid", "otter", "palm_tree", "pear", "pickup_truck", "pine_tree", "plain", "plate", "poppy", "porcupine",
    "possum", "rabbit", "raccoon", "ray", "road", "rocket", "rose", "sea", "seal", "shark", "shrew", "skunk",
    "skyscraper", "snail", "snake", "spider", "squirrel", "streetcar", "sunflower", "sweet_pepper", "table", "tank",
    "telephone", "television", "tiger", "tractor", "train", "trout", "tulip", "turtle", "wardrobe", "whale",
    "willow_tree", "wolf", "woman", "worm"
)
# fmt: on
DIGIT_LABELS = tuple(str(d) for d in range(10))
# The authors' CIFAR normalisation (their code's std, not the dataset's measured one).
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2023, 0.1994, 0.2010)
MNIST_MEAN = (0.1307, 0.1307, 0.1307)
MNIST_STD = (0.3081, 0.3081, 0.3081)

Task = Literal["single_label", "multi_label"]
# how parents are computed from children: "attention" is this package's inverted dot-product attention (Tsai et
# al. 2020); the others are the paper's comparison systems, "dynamic" (Sabour et al. 2017) and "em" (Hinton et al.
# 2018). Each brings its own layers, read-out and loss: capserve.routing.registry.ROUTINGS, keyed by these names.
RoutingAlgorithm = Literal["attention", "dynamic", "em"]
ROUTING_ALGORITHMS: tuple[str, ...] = get_args(RoutingAlgorithm)
# what follows the backbone: "capsules" (a CapsNet), or a baseline CNN (capserve.model.cnn.CNN) whose conv layers have
# as many neurons as the capsule layers they replace, read out by global average pooling ("avgpool") or by a learned
# fully connected layer over the flattened map in place of pooling ("fc"). CNNs have no routing.
Head = Literal["capsules", "avgpool", "fc"]
HEADS: tuple[str, ...] = ("capsules", "avgpool", "fc")


@dataclass(frozen=True)
class CapsuleLayerConfig:
    """One routed capsule layer between the primary capsules and the class capsules."""

    kind: Literal["conv", "fc"]
    types: int  # parent capsule types J
    kernel_size: int = 1  # conv only: k, the window is k×k over all child types
    stride: int = 1  # conv only

    def __post_init__(self) -> None:
        if self.kind not in ("conv", "fc"):
            raise ValueError(f"capsule layer kind must be 'conv' or 'fc', got {self.kind!r}")
        if self.types < 1 or self.kernel_size < 1 or self.stride < 1:
            raise ValueError(f"capsule layer sizes must be positive, got {self}")
        if self.kind == "fc" and (self.kernel_size, self.stride) != (1, 1):
            raise ValueError("fc capsule layers take no kernel_size or stride")


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to build a model (a capsule network, or a baseline CNN) and to preprocess its input."""

    name: str
    labels: tuple[str, ...]
    task: Task = "single_label"
    # input and its normalisation (read by training, export and the service alike)
    in_channels: int = 3
    image_size: int = 32
    mean: tuple[float, ...] = CIFAR_MEAN
    std: tuple[float, ...] = CIFAR_STD
    # backbone: "resnet" = conv3×3-64 + 3 BasicBlocks@64 + 4@channels (first strided); "simple" = one conv3×3;
    # "conv" = conv3×3 + BatchNorm + ReLU layers (64 channels, then channels at backbone_stride, then channels:
    # backbone_layers of them in all);
    # "resnet18" = the standard CIFAR ResNet-18 body (conv3×3-c + [2, 2, 2, 2] BasicBlocks at c, 2c, 4c, 8c, strides
    # 1, 2, 2, 2, with c = backbone_channels, 64 in ResNet-18; backbone_stride unused), CNN heads only: the head
    # follows it directly (no primary or capsule layers to replace)
    backbone: Literal["resnet", "simple", "conv", "resnet18"] = "resnet"
    backbone_channels: int = 128
    backbone_stride: int = 2
    # "conv" only: a max-pool by this factor after the first layer, so that a larger image reaches the capsule layers
    # at the grid their routing was measured at (own images at --image-size N get N // 32: capserve.train.plan)
    stem_pool: int = 1
    # "conv" only: its conv layers, the first two included; the later ones keep the grid (docs/research/backbone.md,
    # "Do more conv layers in front of the capsules help?")
    backbone_layers: int = 3
    # "conv" only: ResNet basic blocks after those layers, at their width and grid (own images: capserve.train.plan)
    backbone_blocks: int = 0
    # CNN heads use the backbone, primary and capsule layer sizes (types × pose_dim neurons) and ignore the rest:
    # iterations, routing, routing_algorithm, pose, layer_norm, activations
    head: Head = "capsules"
    # primary capsules: a conv to primary_types × pose_dim channels, LayerNorm over each pose
    primary_types: int = 32
    primary_kernel: int = 1
    primary_stride: int = 1
    primary_padding: int = 0
    pose: Literal["matrix", "vector"] = "matrix"
    pose_dim: int = 16  # D: 16 is a 4×4 matrix for matrix poses
    capsules: tuple[CapsuleLayerConfig, ...] = ()  # the class capsule layer (fc, one type per label) is implied
    # routing
    iterations: int = 2
    routing: Literal["concurrent", "sequential"] = "concurrent"
    routing_algorithm: RoutingAlgorithm = "attention"
    # the class capsule layer's transforms, when its children lie on a grid: one per child capsule, position
    # included ("per_position", the paper's), or one per child type shared by every position ("shared": a part
    # votes alike wherever it lies, for objects whose place varies; attention routing only)
    class_weights: Literal["per_position", "shared"] = "per_position"
    # with "per_position": one transform per child type in each cell of a class_grid × class_grid partition of that
    # grid instead (rows and columns split as evenly as the side allows, the larger cells first). 1 is "shared", the
    # grid's side is None's one per position; between them a part's place counts at a cell's resolution, and each
    # transform learns from every image with a part anywhere in its cell (attention routing only)
    class_grid: int | None = None
    # the class capsule transforms' initial scale: the authors' init for this many classes (None: the config's own
    # count). Their init grows with the class count (√J), and the larger a transform starts, the less of it AdamW's
    # steps move: a user's many-class run starts as the authors' 10-class one (attention routing only)
    init_classes: int | None = None
    layer_norm: bool = True  # ablation: False replaces LayerNorm by identity
    # the class capsules' LayerNorm: over each class capsule's pose alone ("per_class", the paper's), or over all
    # class capsules together ("joint"), so that a class with little evidence keeps a small pose (and logit) instead
    # of one as large as the winner's (attention routing with layer_norm only)
    class_norm: Literal["per_class", "joint"] = "per_class"
    activations: bool = False  # ablation: children scaled by a learned sigmoid activation before voting
    # multi-label decision thresholds per class, calibrated on a validation split (None: 0.5 each)
    thresholds: tuple[float, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # free-form provenance (never code)

    def __post_init__(self) -> None:
        # JSON gives lists; keep the dataclass hashable and immutable
        for name in ("labels", "mean", "std", "thresholds"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        layers = tuple(c if isinstance(c, CapsuleLayerConfig) else CapsuleLayerConfig(**c) for c in self.capsules)
        object.__setattr__(self, "capsules", layers)

        if self.task not in ("single_label", "multi_label"):
            raise ValueError(f"task must be 'single_label' or 'multi_label', got {self.task!r}")
        if self.head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {self.head!r}")
        if self.backbone == "resnet18" and (self.head == "capsules" or self.capsules):
            raise ValueError(
                "the resnet18 backbone is a complete CNN: use it with head='avgpool' or 'fc' and no "
                "capsule layers (capsules=())"
            )
        for name, least, other_backbones in (("stem_pool", 1, 1), ("backbone_layers", 2, 3), ("backbone_blocks", 0, 0)):
            value = getattr(self, name)
            if value < least or (value != other_backbones and self.backbone != "conv"):
                raise ValueError(f"{name} is the conv backbone's, {least} or more; got {value} ({self.backbone})")
        if self.pose not in ("matrix", "vector"):
            raise ValueError(f"pose must be 'matrix' or 'vector', got {self.pose!r}")
        if self.routing not in ("concurrent", "sequential"):
            raise ValueError(f"routing must be 'concurrent' or 'sequential', got {self.routing!r}")
        if self.routing_algorithm not in ROUTING_ALGORITHMS:
            raise ValueError(f"routing_algorithm must be one of {ROUTING_ALGORITHMS}, got {self.routing_algorithm!r}")
        self._check_class_layer()
        if self.routing_algorithm != "attention" and self.routing != "sequential":
            raise ValueError(
                f"{self.routing_algorithm} routing runs all iterations of a layer before the next, as its paper "
                "does: set routing='sequential'"
            )
        if self.routing_algorithm == "dynamic" and (self.pose != "vector" or self.layer_norm or self.activations):
            raise ValueError(
                "dynamic routing (Sabour et al. 2017) squashes vector poses, with no LayerNorm or activation: set "
                "pose='vector', layer_norm=False, activations=False"
            )
        if self.pose == "matrix" and math.isqrt(self.pose_dim) ** 2 != self.pose_dim:
            raise ValueError(f"matrix poses need a square pose_dim (16 = 4×4), got {self.pose_dim}")
        if self.routing_algorithm == "em" and (self.pose != "matrix" or self.pose_dim < 4):
            raise ValueError(
                f"em routing needs matrix poses of at least 2×2 (the paper's 4×4: pose='matrix', pose_dim=16), got "
                f"pose={self.pose!r}, pose_dim={self.pose_dim}"
            )
        if self.routing_algorithm == "em" and (self.layer_norm or self.activations):
            raise ValueError(
                "em capsules carry their own activation and are not normalised: set layer_norm=False and "
                "activations=False"
            )
        if len(self.labels) < 2:
            raise ValueError("a model needs at least two labels")
        if len(self.mean) != self.in_channels or len(self.std) != self.in_channels:
            raise ValueError(f"mean and std need {self.in_channels} values, one per input channel")
        if any(s <= 0 for s in self.std):
            raise ValueError("std values must be positive")
        if self.iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {self.iterations}")
        if self.thresholds is not None and (
            len(self.thresholds) != len(self.labels) or not all(0 < t < 1 for t in self.thresholds)
        ):
            raise ValueError("thresholds need one value in (0, 1) per label")
        for size in self.spatial_sizes:
            if size < 1:
                raise ValueError(
                    f"{self.name}: feature map shrinks to {size} (sizes {self.spatial_sizes}); "
                    "use a larger image_size or smaller kernels/strides"
                )
        side = self.spatial_sizes[-1] if not self.capsules or self.capsules[-1].kind == "conv" else 0
        if self.class_grid is not None and not (
            1 <= self.class_grid <= side
            and self.class_weights == "per_position"
            and self.routing_algorithm == "attention"
        ):
            grid = f"{side}×{side} here" if side else "none here: an fc capsule layer feeds it"
            raise ValueError(
                f"class_grid splits the grid the class layer reads ({grid}) into cells, 1 to its side, "
                f"with attention routing and class_weights='per_position'; got {self.class_grid}"
            )

    def _check_class_layer(self) -> None:
        """The class capsule layer's options: attention routing's, each one of its values."""
        if self.class_weights not in ("per_position", "shared"):
            raise ValueError(f"class_weights must be 'per_position' or 'shared', got {self.class_weights!r}")
        if self.class_weights == "shared" and self.routing_algorithm != "attention":
            raise ValueError(
                f"class_weights='shared' is attention routing's; {self.routing_algorithm} routing "
                "brings its own class layer"
            )
        if self.class_norm not in ("per_class", "joint"):
            raise ValueError(f"class_norm must be 'per_class' or 'joint', got {self.class_norm!r}")
        if self.class_norm == "joint" and (self.routing_algorithm != "attention" or not self.layer_norm):
            raise ValueError(
                "class_norm='joint' is a LayerNorm over attention routing's class capsules: it needs "
                f"routing_algorithm='attention' and layer_norm=True (got {self.routing_algorithm!r}, {self.layer_norm})"
            )
        if self.init_classes is not None and (self.init_classes < 1 or self.routing_algorithm != "attention"):
            raise ValueError(
                f"init_classes is attention routing's class layer init, a count >= 1; got {self.init_classes} "
                f"({self.routing_algorithm} routing)"
            )

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    @property
    def has_routing(self) -> bool:
        """False for the CNN baselines: no routing iterations to choose, no routing coefficients to explain."""
        return self.head == "capsules"

    @property
    def feature_size(self) -> int:
        """Side of the backbone's output feature map (3×3 convs with padding 1)."""
        if self.backbone == "resnet18":
            return (self.image_size - 1) // 8 + 1  # three stride-2 stages
        return (self.image_size // self.stem_pool - 1) // self.backbone_stride + 1

    @property
    def spatial_sizes(self) -> tuple[int, ...]:
        """Side of each capsule layer's grid: primary, then each conv layer (fc layers have none)."""
        size = (self.feature_size + 2 * self.primary_padding - self.primary_kernel) // self.primary_stride + 1
        sizes = [size]
        for layer in self.capsules:
            if layer.kind == "fc":
                break
            size = (size - layer.kernel_size) // layer.stride + 1
            sizes.append(size)
        return tuple(sizes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build a config from JSON data, refusing keys this version does not know."""
        return cls(**checked_fields(cls, data, "model config"))


def _cifar_layers(extra_fc: tuple[int, ...] = ()) -> tuple[CapsuleLayerConfig, ...]:
    return (
        CapsuleLayerConfig("conv", 32, kernel_size=3, stride=2),
        CapsuleLayerConfig("conv", 32, kernel_size=3, stride=1),
        *(CapsuleLayerConfig("fc", t) for t in extra_fc),
    )


_MULTIMNIST = dict(
    labels=DIGIT_LABELS,
    task="multi_label",
    image_size=36,
    mean=MNIST_MEAN,
    std=MNIST_STD,
    backbone="simple",
    backbone_channels=1024,
    backbone_stride=2,
    primary_types=16,
    primary_kernel=3,
    primary_stride=2,
    primary_padding=1,
    pose_dim=64,
    capsules=(CapsuleLayerConfig("conv", 16, kernel_size=3, stride=1), CapsuleLayerConfig("fc", 10)),
)
_MULTIMNIST_SMALL = {**_MULTIMNIST, "backbone_channels": 256, "pose_dim": 16}

# Dynamic routing (Sabour et al. 2017) in the same networks: vector poses squashed (primary capsules too; no
# LayerNorm), coupling logits updated by agreement, all of a layer's rounds before the next layer (sequential), the
# class capsule's length as its score, margin loss (capserve.routing.dynamic), no reconstruction decoder (the paper's
# CapsNet* comparison trains without one). T = 3 is the original paper's default. Where the seed paper does not give
# the comparison's sizes, poses keep as many values as ours: 16-d vectors for 4×4, 36-d for 6×6, 64-d for 8×8.
_DYNAMIC = dict(pose="vector", routing_algorithm="dynamic", routing="sequential", layer_norm=False, iterations=3)

# EM routing's settings (Hinton et al. 2018): 4×4 matrix poses, no LayerNorm (EM capsules carry activations)
_EM = dict(routing_algorithm="em", routing="sequential", pose="matrix", pose_dim=16, layer_norm=False, iterations=2)

# Hinton et al.'s layout, conv capsules straight into the class capsules (with coordinate addition), not the fc
# capsule layer in between of our other DiverseMultiMNIST configs: with it, EM routing does not learn in a short CPU
# run (docs/benchmarks/learning.md, short training runs)
_MULTIMNIST_EM_SMALL = {
    **_MULTIMNIST,
    **_EM,
    "backbone_channels": 256,
    "primary_types": 8,
    "capsules": (CapsuleLayerConfig("conv", 8, kernel_size=3, stride=2),),
}

MODELS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        ModelConfig("cifar10-resnet", CIFAR10_LABELS, capsules=_cifar_layers()),
        ModelConfig("cifar10-simple", CIFAR10_LABELS, backbone="simple", capsules=_cifar_layers()),
        # the default for a user's own images (docs/own-data.md): cifar10-simple's capsules on three conv + BatchNorm
        # layers instead of one conv, whose features left the capsules far behind a plain CNN; and capsule
        # activations, so that a child with nothing to say (background, clutter) can fall silent: a LayerNorm'd pose
        # has the same size wherever it lies, and without a gate every position votes in full. Training on your own
        # images picks its class_weights from the data (capserve.data.placement), and its class_norm from the task.
        ModelConfig("cifar10-conv", CIFAR10_LABELS, backbone="conv", capsules=_cifar_layers(), activations=True),
        # cifar10-conv with 16-value vector poses, whose 16×16 transform per pair of types holds as many weights as
        # the CNN layer in its place: what a run on multi-label images whose labels follow where things lie takes
        # (capserve.train.class_layer), an option elsewhere (docs/research/multi-label.md, "Do vector poses help
        # multi-label images?")
        ModelConfig(
            "cifar10-conv-vector",
            CIFAR10_LABELS,
            backbone="conv",
            capsules=_cifar_layers(),
            activations=True,
            pose="vector",
        ),
        ModelConfig("cifar100-resnet", CIFAR100_LABELS, pose_dim=36, capsules=_cifar_layers((20,))),
        ModelConfig("cifar100-simple", CIFAR100_LABELS, backbone="simple", pose_dim=36, capsules=_cifar_layers((20,))),
        ModelConfig("multimnist-matrix", pose="matrix", **_MULTIMNIST),
        ModelConfig("multimnist-vector", pose="vector", **_MULTIMNIST),
        # CPU-trainable DiverseMultiMNIST variant: 256 backbone channels and 4×4 poses, a small fraction of
        # multimnist-matrix's parameters, with its layer structure
        ModelConfig("multimnist-matrix-small", pose="matrix", **_MULTIMNIST_SMALL),
        # Baseline CNNs (capserve.model.cnn.CNN). DiverseMultiMNIST: the paper's "baseline CNN" (same backbone, conv
        # layers with the neurons of the capsule layers they replace, average pooling) and its CNN with a learned
        # fully connected layer in place of pooling (the paper's accuracies: docs/benchmarks/learning.md); the layer
        # sizes are multimnist-matrix's (16 types × 64 = 1024 channels). The paper does not give its CNN's
        # normalisation: ours is BatchNorm + ReLU after each replacing conv.
        ModelConfig("multimnist-cnn-avgpool", head="avgpool", **_MULTIMNIST),
        ModelConfig("multimnist-cnn-fc", head="fc", **_MULTIMNIST),
        # CPU-trainable variants with multimnist-matrix-small's sizes (256 backbone channels, 16 types × 16)
        ModelConfig("multimnist-cnn-avgpool-small", head="avgpool", **_MULTIMNIST_SMALL),
        ModelConfig("multimnist-cnn-fc-small", head="fc", **_MULTIMNIST_SMALL),
        # the same on CIFAR-10 (cifar10-simple's sizes, 32 types × 16 = 512 channels): not a row of the paper's, the
        # CNN beside the routing algorithms on one backbone in benchmarks/bench_routing.py
        ModelConfig("cifar10-simple-cnn", CIFAR10_LABELS, backbone="simple", capsules=_cifar_layers(), head="avgpool"),
        ModelConfig("cifar10-conv-cnn", CIFAR10_LABELS, backbone="conv", capsules=_cifar_layers(), head="avgpool"),
        # the paper's CIFAR-100 "baseline CNN" on the simple backbone: cifar100-simple's layer sizes
        # (32 types × 36 = 1152 channels), average pooling (ours: the paper's text does not name this CNN's read-out)
        ModelConfig(
            "cifar100-simple-cnn",
            CIFAR100_LABELS,
            backbone="simple",
            pose_dim=36,
            capsules=_cifar_layers((20,)),
            head="avgpool",
        ),
        # ResNet-18 (He et al. 2016), the paper's strong CNN, in its common CIFAR form: a 3×3
        # stride-1 stem and no max-pool, for 32×32 inputs
        ModelConfig("cifar10-resnet18", CIFAR10_LABELS, backbone="resnet18", backbone_channels=64, head="avgpool"),
        ModelConfig("cifar100-resnet18", CIFAR100_LABELS, backbone="resnet18", backbone_channels=64, head="avgpool"),
        # the paper's Table 1 comparison rows: our CIFAR networks with dynamic routing
        ModelConfig("cifar10-simple-dynamic", CIFAR10_LABELS, backbone="simple", capsules=_cifar_layers(), **_DYNAMIC),
        ModelConfig("cifar10-resnet-dynamic", CIFAR10_LABELS, capsules=_cifar_layers(), **_DYNAMIC),
        ModelConfig(
            "cifar100-simple-dynamic",
            CIFAR100_LABELS,
            backbone="simple",
            pose_dim=36,
            capsules=_cifar_layers((20,)),
            **_DYNAMIC,
        ),
        ModelConfig("cifar100-resnet-dynamic", CIFAR100_LABELS, pose_dim=36, capsules=_cifar_layers((20,)), **_DYNAMIC),
        # DiverseMultiMNIST CapsNet*: multimnist-vector's layers (64-d vectors) with dynamic routing, as the seed
        # paper compares routings on one architecture; and a CPU-trainable variant with the same layers, narrower
        # (backbone 256, 8 primary and 8 conv capsule types, 8-d vectors like the original's primary capsules): a D×D
        # vote matrix per (child, parent) makes 16-d vectors and 16 types far slower to train than
        # multimnist-matrix-small
        ModelConfig("multimnist-capsnet", **{**_MULTIMNIST, **_DYNAMIC}),
        ModelConfig(
            "multimnist-capsnet-small",
            **{
                **_MULTIMNIST,
                **_DYNAMIC,
                "backbone_channels": 256,
                "primary_types": 8,
                "pose_dim": 8,
                "capsules": (CapsuleLayerConfig("conv", 8, kernel_size=3, stride=1), CapsuleLayerConfig("fc", 10)),
            },
        ),
        # EM routing (Hinton et al. 2018), the paper's comparison system: the same backbones and capsule layers as
        # ours, 4×4 poses with activations (the EM paper's), sequential iterations; T = 2, where the seed paper
        # finds EM best (its Figure 4; the EM paper itself uses 3, pick any T per call). CIFAR-100 routes its class
        # capsules straight from the conv capsules, as the EM paper does, not through our fc layer of 20 capsules:
        # with the EM paper's cost, 100 parents fed by 20 children leave parents that one child reaches, whose σ²
        # sits at its floor and whose activation saturates (class logits far from 0 at initialisation).
        *(
            ModelConfig(f"{data}-{backbone}-em", labels, backbone=backbone, capsules=_cifar_layers(), **_EM)
            for data, labels in (("cifar10", CIFAR10_LABELS), ("cifar100", CIFAR100_LABELS))
            for backbone in ("simple", "resnet")
        ),
        # CPU-trainable EM model on DiverseMultiMNIST: multimnist-matrix-small's backbone and primary capsules with 8
        # capsule types instead of 16, the conv capsule layer at stride 2 (4×4 positions instead of 7×7: EM computes
        # every vote at every iteration, forward and backward, so the stride-1, 16-type layer trains far slower than
        # multimnist-matrix-small) and no fc capsule layer (see _MULTIMNIST_EM_SMALL).
        ModelConfig("multimnist-em-small", **_MULTIMNIST_EM_SMALL),
    )
}


def list_models() -> list[str]:
    """Names accepted by ``create_model``, sorted."""
    return sorted(MODELS)


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """The named configuration with ``overrides`` applied (validated like any config)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(list_models())}")
    config = MODELS[name]
    return dataclasses.replace(config, **overrides) if overrides else config
