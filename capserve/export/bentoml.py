"""``capserve export bentoml MODEL_DIR --name NAME``: a model folder as one model in BentoML's model store.

The store keeps versioned tags (``bentoml models list``), ``bentoml build`` packs the models a bentofile names
into the bento, and ``bentoml models push`` uploads them. The stored model is the whole serving folder:
``config.json``, ``model.safetensors``, ``model.onnx`` and ``model-explain.onnx`` (exported into the stored copy
when the folder lacks them; the source folder is never written), the folder's other graphs (an INT8 graph,
``model-int8.onnx``), a TensorRT engine with its sidecar when present, ``tuned.json`` and ``MODEL_CARD.md``. Every
graph must have been exported from the folder's weights. The unfamiliarity calibration
(``familiarity.safetensors``) travels too. The service serves it with ``CAPSERVE_MODEL=NAME[:VERSION]``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from capserve.errors import ExportError
from capserve.hashing import file_sha256
from capserve.model.checkpoint import CONFIG, WEIGHTS, read_config, read_extra
from capserve.runtime.familiarity import FAMILIARITY_FILE
from capserve.runtime.metadata import METADATA_KEY

from .onnx import read_metadata

log = logging.getLogger(__name__)

ONNX, EXPLAIN_ONNX = "model.onnx", "model-explain.onnx"
# copied when present; the tuned file travels with the model into a bento (capserve.serving.tuned)
OPTIONAL = ("model.plan", "model.plan.json", "MODEL_CARD.md", "tuned.json", FAMILIARITY_FILE)
EXPORT_FLAGS = {ONNX: "", EXPLAIN_ONNX: " --explain"}  # how each graph is made; any other: an INT8 one
MODULE = "capserve"  # the stored model's framework ("module") in `bentoml models list`


def _onnx_weights_sha256(path: Path) -> str:
    import onnx

    props = read_metadata(onnx.load(str(path), load_external_data=False))
    if METADATA_KEY not in props:
        raise ExportError(f"{path} has no {METADATA_KEY!r} metadata: re-export it with `capserve export onnx`")
    return json.loads(props[METADATA_KEY]).get("weights_sha256", "")


def store_labels_and_metadata(directory: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """BentoML labels (task, dataset, config name) and metadata (iterations, weights hash, metrics when known)."""
    config = read_config(directory)
    saved = read_extra(directory)
    labels = {"task": config.task, "dataset": config.name.split("-")[0], "config": config.name}
    import capserve

    metadata: dict[str, Any] = {
        "head": config.head,  # "capsules", or a baseline CNN's read-out (which has no routing iterations)
        **({"iterations": config.iterations} if config.has_routing else {}),
        "weights_sha256": file_sha256(directory / WEIGHTS),
        "classes": len(config.labels),
        "capserve_version": capserve.__version__,
    }
    metrics = dict(saved.get("metrics") or {})  # validation figures recorded with the checkpoint
    summary = directory.parent / "summary.json"  # `capserve train --out RUN` writes RUN/best and RUN/summary.json
    if summary.is_file():
        metrics.update({k: v for k, v in json.loads(summary.read_text()).items() if k.startswith("test_")})
    metrics = {k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    if metrics:
        metadata["metrics"] = metrics
    return labels, metadata


def save_to_store(directory: str | Path, name: str) -> str:
    """Save a model folder to BentoML's model store as ``name``; returns the new tag ``name:version``."""
    import bentoml
    from bentoml.exceptions import BentoMLException

    from .onnx import export_checkpoint

    directory = Path(directory)
    if not (directory / CONFIG).is_file() or not (directory / WEIGHTS).is_file():
        raise ExportError(f"{directory} is not a model directory (it needs {CONFIG} and {WEIGHTS})")
    labels, metadata = store_labels_and_metadata(directory)
    config = read_config(directory)
    digests = {metadata["weights_sha256"]}  # what `capserve export onnx DIR` records
    # every graph in the folder: the fp32 ones first (an INT8 graph, model-int8.onnx, is a runtime the server may
    # choose, by a tuned file or its start-up measurement)
    others = sorted(path.name for path in directory.glob("*.onnx") if path.name not in (ONNX, EXPLAIN_ONNX))
    graphs = (ONNX, EXPLAIN_ONNX, *others)
    for graph in graphs:
        if (directory / graph).is_file() and len(digests) == 1:
            import capserve

            from .onnx import weights_sha256

            digests.add(weights_sha256(capserve.load(directory)))  # what export_onnx(model) records
        if (directory / graph).is_file() and _onnx_weights_sha256(directory / graph) not in digests:
            raise ExportError(
                f"{directory / graph} was exported from other weights than {directory / WEIGHTS}: "
                f"re-export it (`capserve export onnx {directory} -o {directory / graph}"
                f"{EXPORT_FLAGS.get(graph, ' --int8 --calibration DATA')}`) or delete it"
            )
    try:
        with bentoml.models.create(name, labels=labels, metadata=metadata, module=MODULE) as stored:
            target = Path(stored.path)
            for file in (CONFIG, WEIGHTS, *graphs, *OPTIONAL):
                if (directory / file).is_file():
                    shutil.copy2(directory / file, target / file)
            for graph, explain in ((ONNX, False), (EXPLAIN_ONNX, True)):
                if not (target / graph).is_file() and (config.has_routing or not explain):  # CNNs: nothing to explain
                    log.info("%s has no %s: exporting it into the stored model", directory, graph)
                    export_checkpoint(directory, target / graph, explain=explain)
    except BentoMLException as e:
        raise ExportError(f"cannot save {directory} to BentoML's model store as {name!r}: {e}") from e
    return str(stored.tag)
