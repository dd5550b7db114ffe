"""Export to ONNX: the fixed-T routing unrolled into a plain graph, with the model's metadata inside the file.

The model's Python loop over routing iterations runs at trace time, so the graph holds exactly the updates
the eager model computes for that T: no Loop or If node, the first iteration without a vote tensor, and
updates that never reach the output skipped. One file per T.

Graph contract:
    input   ``images``      float32 (batch, C, H, W), normalised (``capserve.data.preprocess``); batch is dynamic.
    output  ``logits``      float32 (batch, num_classes).
    output  ``part_whole``  float32 (batch, num_classes, H', W', I'), explain graphs only (see
                            ``capserve.model.part_whole``).

Metadata (``metadata_props``): ``capserve.metadata`` holds ``ModelMetadata.to_json()``, the one key runtimes
read; ``capserve.precision`` and ``capserve.outputs`` describe the graph; ``capserve.config`` holds the architecture
(``ModelConfig`` JSON), from which the ONNX runtime sizes the chunks of a large batch; the other keys repeat fields
for people reading the file with other tools (Netron, ``onnx.load``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import capserve
from capserve.configs import ModelConfig
from capserve.errors import ExportError
from capserve.files import partial_file
from capserve.hashing import file_sha256
from capserve.model.capsnet import CapsNet, part_whole
from capserve.model.checkpoint import WEIGHTS, not_learned_warning
from capserve.runtime.familiarity import FAMILIARITY_FILE
from capserve.runtime.metadata import (
    CLASS_POSES,
    CONFIG_KEY,
    LOGITS,
    METADATA_KEY,
    PART_WHOLE,
    PRECISION_KEY,
    ModelMetadata,
)

log = logging.getLogger(__name__)

INPUT = "images"
OUTPUTS_KEY = "capserve.outputs"
DEFAULT_OPSET = 20
MIN_OPSET = 18  # the dynamo exporter cannot write older opsets
MAX_BATCH = 1 << 16  # upper bound of the dynamic batch axis (a bound the exporter needs, not a runtime limit)


class Unrolled(nn.Module):
    """``model(images, iterations=T)`` with T fixed, so that tracing unrolls the routing loop; a capsule network's
    class capsules beside the logits (its unfamiliarity score reads them: ``capserve.runtime.familiarity``)."""

    def __init__(self, model: CapsNet, iterations: int):
        super().__init__()
        self.model, self.iterations = model, iterations

    def forward(self, images: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        if not self.model.config.has_routing:
            return self.model(images, iterations=self.iterations)  # (B, C)
        poses, _ = self.model.route(images, self.iterations, keep_coefficients=False)
        return self.model.logits_from(poses[-1]), poses[-1]  # (B, C), (B, C, D)


class UnrolledExplain(Unrolled):
    """Logits, the part-whole parse (see ``RoutingTrace.part_whole``) and the class capsules for a fixed T."""

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        poses, coefficients = self.model.route(images, self.iterations, keep_coefficients=True)
        logits = self.model.logits_from(poses[-1])  # (B, C), whatever the routing's read-out
        return logits, part_whole(poses, coefficients), poses[-1]  # (B, C), (B, C, H, W, I), (B, C, D)


def weights_sha256(model: CapsNet) -> str:
    """SHA-256 of a model's weights (names, dtypes, shapes and bytes, in name order), for in-memory models.

    Exports from a model directory record the SHA-256 of its ``model.safetensors`` file instead (what the
    torch runtime reports, and what ``capserve verify`` compares); ``capserve.model.checkpoint`` writes the same
    weights to the same bytes, so that hash is stable across re-saves.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().contiguous().cpu()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def load_checkpoint(checkpoint: str | Path) -> tuple[CapsNet, str]:
    """A model directory's model (CPU, eval) and the SHA-256 of its weights file (a warning for one whose training
    run did not learn: exporting it is allowed, serving its answers is rarely what anyone wants)."""
    warning = not_learned_warning(checkpoint)
    if warning:
        log.warning("%s", warning)
    model = capserve.load(checkpoint, "cpu")
    return model, file_sha256(Path(checkpoint) / WEIGHTS)


def metadata_props(
    metadata: ModelMetadata, precision: str, outputs: Sequence[str], config: ModelConfig | None = None
) -> dict[str, str]:
    """The key/value pairs written into an exported file's ``metadata_props``."""
    # the architecture, for runtimes that size their work by it (not ``extra``: training provenance stays home)
    architecture = {} if config is None else {CONFIG_KEY: json.dumps({**config.to_dict(), "extra": {}})}
    return {
        METADATA_KEY: metadata.to_json(),
        **architecture,
        PRECISION_KEY: precision,
        OUTPUTS_KEY: ",".join(outputs),
        "name": metadata.name,
        "task": metadata.task,
        "labels": json.dumps(list(metadata.labels)),
        "input_shape": "x".join(map(str, metadata.input_shape)),
        "mean": json.dumps(list(metadata.mean)),
        "std": json.dumps(list(metadata.std)),
        "iterations": "none" if metadata.iterations is None else str(metadata.iterations),
        "capserve_version": metadata.capserve_version,
        "weights_sha256": metadata.weights_sha256,
    }


def set_metadata(proto: Any, props: dict[str, str]) -> None:
    """Replace ``proto.metadata_props`` (an ``onnx.ModelProto``) by ``props``."""
    del proto.metadata_props[:]
    for key, value in props.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value


STACK_TRACE_KEY = "pkg.torch.onnx.stack_trace"


def drop_stack_traces(proto: Any) -> None:
    """Remove the exporter's per-node stack traces: they name the source files of the machine that exported the
    graph, which a shipped model must not carry (the module names in ``namespace`` and the class hierarchy stay)."""
    nodes = [*proto.graph.node, *(n for f in proto.functions for n in f.node)]
    for node in nodes:
        kept = [(p.key, p.value) for p in node.metadata_props if p.key != STACK_TRACE_KEY]
        if len(kept) != len(node.metadata_props):
            del node.metadata_props[:]
            for key, value in kept:
                entry = node.metadata_props.add()
                entry.key, entry.value = key, value


def read_metadata(proto: Any) -> dict[str, str]:
    """``metadata_props`` of an ``onnx.ModelProto`` as a dict."""
    return {p.key: p.value for p in proto.metadata_props}


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the exporter's chatter: per-op registration warnings ("torchvision is not installed") and the
    graph optimiser's INFO lines, which are about the exporter's internals, not the user's model."""
    levels = {
        "torch.onnx._internal.exporter._registration": logging.ERROR,
        "onnxscript": logging.WARNING,
        "onnx_ir": logging.WARNING,
    }
    saved = {name: logging.getLogger(name).level for name in levels}
    for name, level in levels.items():
        logging.getLogger(name).setLevel(max(level, logging.getLogger(name).getEffectiveLevel()))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)  # torch's own deprecations, not the user's
            yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def to_onnx_proto(model: CapsNet, iterations: int, opset: int = DEFAULT_OPSET, explain: bool = False) -> Any:
    """Trace ``model`` at fixed ``iterations`` into an in-memory ``onnx.ModelProto`` (weights inside, no metadata)."""
    if opset < MIN_OPSET:
        raise ExportError(f"opset {opset} is not supported: the exporter writes opset >= {MIN_OPSET}; use --opset 18+")
    T = model.resolve_iterations(iterations)
    c = model.config
    if explain and not c.has_routing:
        raise ExportError(f"{c.name} is a CNN without routing: there is no part-whole parse to export; drop --explain")
    wrapper = (UnrolledExplain if explain else Unrolled)(model.eval(), T).eval()
    example = torch.zeros(2, c.in_channels, c.image_size, c.image_size)  # batch 2: 1 would be specialised
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    outputs = [LOGITS, PART_WHOLE, CLASS_POSES] if explain else [LOGITS, CLASS_POSES] if c.has_routing else [LOGITS]
    with _quiet_exporter(), torch.no_grad():
        program = torch.onnx.export(
            wrapper,
            (example,),
            dynamo=True,
            opset_version=opset,
            input_names=[INPUT],
            output_names=outputs,
            dynamic_shapes={"images": {0: batch}},
            optimize=True,
            verbose=False,
        )
    if program is None:  # pragma: no cover - only the legacy exporter returns None
        raise ExportError("torch.onnx.export returned no program; upgrade torch to >= 2.6")
    return program.model_proto


def export_onnx(
    model: CapsNet,
    path: str | Path,
    iterations: int | None = None,
    *,
    opset: int = DEFAULT_OPSET,
    explain: bool = False,
    fp16: bool = False,
    weights_digest: str | None = None,
) -> Path:
    """Export ``model`` with ``iterations`` routing iterations unrolled to one self-contained ONNX file.

    Args:
        model: a CapsNet (moved to CPU for tracing; put back afterwards).
        path: the .onnx file to write (its folder is created).
        iterations: T, default the config's (None for a CNN, which has no routing).
        opset: ONNX opset, >= 18.
        explain: add the ``part_whole`` output.
        fp16: FP16 weights and compute, LayerNormalization and Softmax kept in FP32, FP32 inputs/outputs
            (see ``capserve.export.fp16``).
        weights_digest: SHA-256 of the checkpoint's weights file; ``weights_sha256(model)`` when None.
    Returns:
        ``path``. The file passes ``onnx.checker.check_model(full_check=True)``.
    """
    import onnx

    T = model.resolve_iterations(iterations)
    device = next(model.parameters()).device
    training = model.training
    try:
        proto = to_onnx_proto(model.cpu(), T, opset, explain)
    finally:
        model.to(device).train(training)
    precision = "fp32"
    if fp16:
        from capserve.export.fp16 import convert_to_fp16

        proto, precision = convert_to_fp16(proto), "fp16"
    metadata = ModelMetadata.from_config(
        model.config, T, capserve_version=capserve.__version__, weights_sha256=weights_digest or weights_sha256(model)
    )
    outputs = [o.name for o in proto.graph.output]
    drop_stack_traces(proto)
    set_metadata(proto, metadata_props(metadata, precision, outputs, model.config))
    proto.producer_name = "capserve"
    proto.producer_version = capserve.__version__
    proto.doc_string = (
        f"{metadata.name}: capsule network, {T} routing iteration(s) unrolled"
        if T is not None
        else f"{metadata.name}: CNN ({model.config.head} head), no routing"
    )
    onnx.checker.check_model(proto, full_check=True)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # written beside the destination, then renamed over it: an export killed or failing half-way leaves the file a
    # server would load (a new one, or the one there before) whole
    with partial_file(path) as partial:
        onnx.save_model(proto, str(partial), save_as_external_data=False)
    log.info("wrote %s (%s, T=%s, opset %d%s)", path, precision, T, opset, ", explain" if explain else "")
    return path


def output_paths(output: str | Path, iterations: Sequence[int]) -> list[Path]:
    """One file per T: ``output`` itself for a single T, else ``stem-T{t}.onnx`` beside it."""
    output = Path(output)
    if len(set(iterations)) != len(iterations):
        raise ExportError(f"--iterations lists a value twice: {list(iterations)}")
    if len(iterations) == 1:
        return [output]
    return [output.with_name(f"{output.stem}-T{t}{output.suffix or '.onnx'}") for t in iterations]


def export_checkpoint(
    checkpoint: str | Path, output: str | Path, iterations: Sequence[int] | None = None, **options: Any
) -> list[Path]:
    """Export a model directory once per T in ``iterations`` (default: the config's); returns the files written.
    The folder's unfamiliarity calibration goes beside graphs written into another folder, where a server opening
    the graph file reads it (``capserve.pipeline.models.open_model``)."""
    model, digest = load_checkpoint(checkpoint)
    Ts = list(iterations) if iterations else [model.resolve_iterations(None)]  # the config's T (None: a CNN)
    for T in Ts:
        model.resolve_iterations(T)  # validate all before the (slow) exports start
    written = [
        export_onnx(model, path, T, weights_digest=digest, **options)
        for T, path in zip(Ts, output_paths(output, Ts), strict=True)
    ]
    calibration = Path(checkpoint) / FAMILIARITY_FILE
    for folder in {path.parent.resolve() for path in written} - {Path(checkpoint).resolve()}:
        if calibration.is_file():
            shutil.copy2(calibration, folder / FAMILIARITY_FILE)
    return written
