"""Every JSON record capserve reads back (model config, model metadata, engine sidecar, INT8 summary) accepts only
the fields its dataclass declares, needs the required ones, and says which keys are at fault."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from capserve.configs import ModelConfig, get_config
from capserve.errors import ExportError, RuntimeLoadError
from capserve.export.int8 import Int8Summary
from capserve.records import checked_fields
from capserve.runtime.metadata import Int8Check, ModelMetadata
from capserve.runtime.tensorrt_backend import EngineSidecar


@dataclasses.dataclass
class Record:
    name: str
    size: int = 1
    tags: tuple[str, ...] = dataclasses.field(default_factory=tuple)


def test_checked_fields_passes_a_record_with_its_fields():
    assert checked_fields(Record, {"name": "a"}, "record") == {"name": "a"}
    assert checked_fields(Record, {"name": "a", "size": 2, "tags": []}, "record")["size"] == 2


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "a", "colour": "red"}, r"unknown record keys \['colour'\]; known keys: \['name', 'size', 'tags'\]"),
        ({"size": 2}, r"record lacks \['name'\]"),  # a field with a default_factory is not required
        (["name"], "record must be a JSON object, got list"),
    ],
)
def test_checked_fields_names_the_keys_at_fault(data, message):
    with pytest.raises(ValueError, match=message):
        checked_fields(Record, data, "record")


def metadata() -> ModelMetadata:
    return ModelMetadata.from_config(get_config("cifar10-simple"), 2, capserve_version="0", weights_sha256="ab")


def test_model_config_refuses_unknown_and_missing_keys():
    data = get_config("cifar10-simple").to_dict()
    assert ModelConfig.from_dict(dict(data)) == get_config("cifar10-simple")
    with pytest.raises(ValueError, match=r"unknown model config keys \['colour'\]"):
        ModelConfig.from_dict({**data, "colour": 1})
    with pytest.raises(ValueError, match=r"model config lacks \['name'\]"):
        ModelConfig.from_dict({k: v for k, v in data.items() if k != "name"})


def test_model_metadata_refuses_unknown_and_missing_keys():
    data = json.loads(metadata().to_json())
    assert ModelMetadata.from_json(json.dumps(data)) == metadata()
    with pytest.raises(RuntimeLoadError, match=r"unknown model metadata keys \['colour'\]"):
        ModelMetadata.from_json(json.dumps({**data, "colour": 1}))
    with pytest.raises(RuntimeLoadError, match=r"model metadata lacks \['labels'\]"):
        ModelMetadata.from_json(json.dumps({k: v for k, v in data.items() if k != "labels"}))


def test_engine_sidecar_refuses_unknown_and_missing_keys(tmp_path):
    sidecar = EngineSidecar(
        tensorrt_version="10.0",
        gpu_name="NVIDIA H200",
        engine_sha256="cd",
        onnx_sha256="ef",
        min_batch=1,
        opt_batch=8,
        max_batch=32,
        input_name="images",
        outputs=("logits",),
        precision="fp32",
        metadata=metadata(),
    )
    data = json.loads(sidecar.to_json())
    path = tmp_path / "model.plan.json"
    path.write_text(json.dumps(data))
    assert EngineSidecar.read(path) == sidecar
    path.write_text(json.dumps({**data, "colour": 1}))
    with pytest.raises(RuntimeLoadError, match=r"unknown engine sidecar keys \['colour'\]"):
        EngineSidecar.read(path)
    path.write_text(json.dumps({k: v for k, v in data.items() if k != "gpu_name"}))
    with pytest.raises(RuntimeLoadError, match=r"engine sidecar lacks \['gpu_name'\]"):
        EngineSidecar.read(path)


def test_int8_summary_refuses_unknown_and_missing_keys():
    fields = {f.name: 0 for f in dataclasses.fields(Int8Summary)}
    summary = Int8Summary(
        **{**fields, "quantized_ops": ("Conv",), "float_nodes": (), "kept_float": (), "variants": ({"variant": "a"},)}
    )
    data = json.loads(summary.to_json())
    assert Int8Summary.from_json(json.dumps(data)) == summary
    with pytest.raises(ExportError, match=r"unknown int8 summary keys \['colour'\]"):
        Int8Summary.from_json(json.dumps({**data, "colour": 1}))
    with pytest.raises(ExportError, match=r"int8 summary lacks \['target'\]"):
        Int8Summary.from_json(json.dumps({k: v for k, v in data.items() if k != "target"}))
    with pytest.raises(ExportError, match="not a capserve int8 summary"):
        Int8Summary.from_json("{not json")


def test_an_int8_summary_of_an_older_capserve_reads_without_the_speed_fields():
    """Files written before the export measured speed on its machine lack those keys: they read back as unknown."""
    older = {f.name: 0 for f in dataclasses.fields(Int8Summary) if f.default is dataclasses.MISSING}
    older.update(quantized_ops=["Conv"], float_nodes=[], kept_float=[])
    summary = Int8Summary.from_json(json.dumps(older))
    assert (summary.variant, summary.cpu, summary.speedup, summary.variants, summary.kept_slow) == (
        "u8s8",
        None,
        None,
        (),
        False,
    )


def test_int8_check_refuses_unknown_and_missing_keys_and_mismatched_logits():
    pixels = np.arange(2 * 3 * 4 * 4, dtype=np.uint8).reshape(2, 3, 4, 4)
    check = Int8Check.build(pixels, np.eye(2, 3), np.eye(2, 3), 0.97, "a CPU")
    data = json.loads(check.to_json())
    again = Int8Check.from_json(json.dumps(data))
    assert again == check and np.array_equal(again.images(), pixels)
    with pytest.raises(RuntimeLoadError, match=r"unknown int8 check keys \['colour'\]"):
        Int8Check.from_json(json.dumps({**data, "colour": 1}))
    with pytest.raises(RuntimeLoadError, match=r"int8 check lacks \['bound'\]"):
        Int8Check.from_json(json.dumps({k: v for k, v in data.items() if k != "bound"}))
    with pytest.raises(RuntimeLoadError, match="holds 2 images but logits for another number"):
        Int8Check.from_json(json.dumps({**data, "fp32_logits": data["fp32_logits"][:1]}))
    with pytest.raises(RuntimeLoadError, match="not a capserve int8 check"):
        Int8Check.from_json(json.dumps({**data, "shape": [3, 3, 4, 4]}))  # more images than the pixels hold
