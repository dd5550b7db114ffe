"""TensorRT backend: a serialised engine from ``capserve export tensorrt`` and its JSON sidecar.

An engine only runs on the TensorRT version and GPU model that built it. The sidecar (``model.plan.json``
next to ``model.plan``) records both, with the engine's hash, the batch range of its optimisation profile and
the model's metadata; the runtime refuses a mismatch before deserialising anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from capserve.errors import InputError, RuntimeLoadError
from capserve.hashing import sha256_bytes
from capserve.records import checked_fields
from capserve.runtime.base import Explanation, Runtime
from capserve.runtime.metadata import CLASS_POSES, LOGITS, PART_WHOLE, ModelMetadata

SIDECAR_FORMAT = 1
TENSORRT_MISSING = (
    "TensorRT is not installed: it runs only on NVIDIA GPU machines. Install it there with "
    "`pip install tensorrt` (NVIDIA's wheels), or use the onnxruntime backend on this machine"
)


def sidecar_path(engine: str | Path) -> Path:
    """``model.plan`` → ``model.plan.json``."""
    engine = Path(engine)
    return engine.with_name(engine.name + ".json")


def import_tensorrt() -> Any:
    """``import tensorrt``, or a RuntimeLoadError that says how to get it."""
    try:
        import tensorrt
    except ImportError as e:
        raise RuntimeLoadError(TENSORRT_MISSING) from e
    return tensorrt


def gpu_name(device: str = "cuda") -> str:
    """The GPU model name as CUDA reports it (what an engine is tied to)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeLoadError(
            "TensorRT engines need an NVIDIA GPU visible to torch (torch.cuda.is_available() is False): "
            "install the CUDA build of torch and check the driver with nvidia-smi"
        )
    return torch.cuda.get_device_name(torch.device(device))


@dataclass(frozen=True)
class EngineSidecar:
    """What an engine was built from and for; JSON next to the engine."""

    tensorrt_version: str
    gpu_name: str
    onnx_sha256: str
    engine_sha256: str
    min_batch: int
    opt_batch: int
    max_batch: int
    input_name: str
    outputs: tuple[str, ...]
    precision: str
    metadata: ModelMetadata
    format_version: int = SIDECAR_FORMAT

    def __post_init__(self) -> None:
        if not 1 <= self.min_batch <= self.opt_batch <= self.max_batch:
            raise ValueError(
                f"batch sizes need 1 <= min <= opt <= max, got min {self.min_batch}, "
                f"opt {self.opt_batch}, max {self.max_batch}"
            )

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["metadata"] = json.loads(self.metadata.to_json())
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def read(cls, path: str | Path) -> EngineSidecar:
        """Parse a sidecar file, accepting only known keys."""
        path = Path(path)
        if not path.is_file():
            raise RuntimeLoadError(
                f"{path} not found: an engine needs the JSON sidecar that `capserve export "
                "tensorrt` writes next to it (TensorRT version, GPU, model metadata)"
            )
        try:
            data = json.loads(path.read_text())
            checked_fields(cls, data, "engine sidecar")
            if data.get("format_version") != SIDECAR_FORMAT:
                raise ValueError(f"format_version {data.get('format_version')!r} is not {SIDECAR_FORMAT}")
            data["metadata"] = ModelMetadata.from_json(json.dumps(data["metadata"]))
            data["outputs"] = tuple(data["outputs"])
            return cls(**data)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise RuntimeLoadError(
                f"{path} is not a valid engine sidecar ({e}); rebuild the engine with `capserve export tensorrt`"
            ) from e

    def check(self, engine: Path, engine_bytes: bytes, tensorrt_version: str, gpu: str) -> None:
        """Refuse an engine that was built elsewhere or does not belong to this sidecar."""
        rebuild = f"rebuild it here with `capserve export tensorrt MODEL.onnx -o {engine}`"
        if sha256_bytes(engine_bytes) != self.engine_sha256:
            raise RuntimeLoadError(
                f"{engine} does not match its sidecar's engine_sha256 (changed or truncated after the build); {rebuild}"
            )
        if tensorrt_version != self.tensorrt_version:
            raise RuntimeLoadError(
                f"{engine} was built with TensorRT {self.tensorrt_version} but TensorRT "
                f"{tensorrt_version} is installed; engines only load in the version that "
                f"built them: {rebuild}"
            )
        if gpu != self.gpu_name:
            raise RuntimeLoadError(
                f"{engine} was built for {self.gpu_name!r} but this GPU is {gpu!r}; engines "
                f"are tuned to one GPU model: {rebuild}"
            )

    def check_batch_size(self, batch: int) -> None:
        if not self.min_batch <= batch <= self.max_batch:
            raise InputError(
                f"batch of {batch} is outside the engine's optimisation profile [{self.min_batch}, "
                f"{self.max_batch}]: split the batch, or rebuild with --min-batch/--max-batch"
            )


class CudaMemory:
    """The CUDA side of a TensorRT runtime, in torch: the device (with its index), one stream, buffers, copies.

    ``torch.cuda.set_device`` needs an index ("cuda" alone raises ValueError), so "cuda" means the current device.
    """

    def __init__(self, device: str):
        import torch

        index = torch.device(device).index
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        torch.cuda.set_device(self.device)
        self.stream = torch.cuda.Stream(self.device)

    @property
    def stream_handle(self) -> int:
        return self.stream.cuda_stream

    def scope(self) -> contextlib.ExitStack:
        """Make this device and stream current (torch's allocations and copies go there)."""
        import torch

        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(self.stream))
        return stack

    def upload(self, array: np.ndarray, dtype: Any) -> Any:
        import torch

        return torch.from_numpy(array).to(self.device, dtype, non_blocking=True)

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        import torch

        return torch.empty(shape, dtype=dtype, device=self.device)

    def download(self, tensor: Any) -> np.ndarray:
        """float32 host copy; waits for the stream (the engine's results are complete after it)."""
        result = tensor.float().cpu()
        self.stream.synchronize()
        return result.numpy()


class TensorRTRuntime(Runtime):
    """A TensorRT engine; input and output buffers are torch CUDA tensors.

    One execution context, used by one thread at a time: TensorRT's contexts are not thread-safe, and
    ``execute_async_v3`` releases the GIL, so concurrent requests (the server's worker threads) would overwrite
    each other's shapes and addresses. A lock serialises the whole set-shape/set-address/execute/copy sequence;
    the GPU runs one batch at a time anyway, and adaptive batching merges concurrent requests.

    Args:
        path: engine file (.plan/.engine) with its ``.json`` sidecar beside it.
        device: "cuda" (the current device) or "cuda:N".
    """

    backend = "tensorrt"

    def __init__(self, path: str | Path, device: str = "cuda"):
        self.path = Path(path)
        if not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
            raise ValueError(f"TensorRT engines run on a GPU: use device='cuda' or 'cuda:N', got {device!r}")
        self.sidecar = EngineSidecar.read(sidecar_path(self.path))
        self.metadata = self.sidecar.metadata
        self.precision = self.sidecar.precision
        trt = import_tensorrt()
        data = self.path.read_bytes()
        self.sidecar.check(self.path, data, trt.__version__, gpu_name(device))
        self.memory = CudaMemory(device)
        self.device = self.memory.device
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(data)
        if self.engine is None:
            raise RuntimeLoadError(f"TensorRT could not deserialise {self.path} (see its log above); rebuild it")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self._inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self._outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        if self._inputs != [self.sidecar.input_name] or LOGITS not in self._outputs:
            raise RuntimeLoadError(
                f"{self.path} has inputs {self._inputs} and outputs {self._outputs}; its sidecar "
                f"says {self.sidecar.input_name!r} → {list(self.sidecar.outputs)}"
            )
        self._dtypes = {n: _torch_dtype(trt, self.engine.get_tensor_dtype(n)) for n in names}
        self.context = self.engine.create_execution_context()
        self._lock = threading.Lock()

    @property
    def providers(self) -> list[str]:
        return [f"TensorRT:{self.device}"]

    def check_batch(self, batch: np.ndarray) -> np.ndarray:
        batch = super().check_batch(batch)
        self.sidecar.check_batch_size(batch.shape[0])
        return batch

    def _run(self, batch: np.ndarray, outputs: list[str]) -> list[np.ndarray]:
        name = self.sidecar.input_name
        with self._lock, self.memory.scope():
            x = self.memory.upload(batch, self._dtypes[name])
            if not self.context.set_input_shape(name, tuple(x.shape)):
                raise InputError(f"TensorRT refused input shape {tuple(x.shape)}")
            self.context.set_tensor_address(name, x.data_ptr())
            buffers = {}
            for output in self._outputs:  # every output needs an address, wanted or not
                shape = tuple(self.context.get_tensor_shape(output))
                buffers[output] = self.memory.empty(shape, self._dtypes[output])
                self.context.set_tensor_address(output, buffers[output].data_ptr())
            if not self.context.execute_async_v3(self.memory.stream_handle):
                raise RuntimeError(f"TensorRT failed to run {self.path} (see its log above)")
            return [self.memory.download(buffers[n]) for n in outputs]  # the stream is done before the lock opens

    def _predict(self, batch: np.ndarray) -> np.ndarray:
        return self._run(batch, [LOGITS])[0]

    def infer(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        if CLASS_POSES not in self._outputs:  # an engine built from a graph exported without them
            return self.predict(batch), None
        logits, poses = self._run(self.check_batch(batch), [LOGITS, CLASS_POSES])
        return logits, poses

    def explain(self, batch: np.ndarray) -> Explanation:
        if PART_WHOLE not in self._outputs:
            raise NotImplementedError(
                f"{self.path} has no {PART_WHOLE!r} output: build it from an ONNX file "
                "exported with `capserve export onnx --explain`"
            )
        logits, parse = self._run(self.check_batch(batch), [LOGITS, PART_WHOLE])
        return Explanation(logits, parse)


def _torch_dtype(trt: Any, dtype: Any) -> Any:
    import torch

    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32, trt.int8: torch.int8}
    if hasattr(trt, "bfloat16"):
        table[trt.bfloat16] = torch.bfloat16
    if dtype not in table:
        raise RuntimeLoadError(f"unsupported engine tensor type {dtype}")
    return table[dtype]
