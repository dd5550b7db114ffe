"""Strict stand-ins for GPU software on machines without a GPU: the TensorRT 10 Python API (``fake_tensorrt``) and
torch.cuda's device rules (``strict_cuda``), so that the TensorRT runtime and GPU placement are tested on CPUs."""

from __future__ import annotations

import types

import numpy as np
import torch


class ContractError(AssertionError):
    """A call the real TensorRT would reject or turn into undefined behaviour."""


def fake_tensorrt(
    parse_ok: bool = True, profile: tuple[int, int] = (1, 64), cache_from: bytes = b"", version: str = "10.13.0"
) -> types.ModuleType:
    """A strict stand-in for the TensorRT 10 Python API: the builder calls are recorded; the "engine" it builds is
    the parsed ONNX graph run by ONNX Runtime on the CPU, behind TensorRT's runtime contracts:

    - ``Runtime.deserialize_cuda_engine`` needs a current CUDA device set with an index (see ``strict_cuda``);
    - tensors have modes: only INPUT tensors take ``set_input_shape``, and a shape must have the engine's rank,
      its fixed dimensions and a batch inside the optimisation profile (else False, as TensorRT returns);
    - an output's shape is known only after every input shape is set (-1 before);
    - ``execute_async_v3`` needs every input shape and every I/O address set and a stream handle, reads the input
      from its device address and writes every output to its address;
    - a context is used by one thread at a time ("Do not call the APIs of the same IExecutionContext from
      multiple threads at any given time"): a call while another thread is inside its set-shape → execute
      sequence raises ``ContractError`` and is recorded in ``trt.violations``. ``execute_async_v3`` sleeps
      (the real one releases the GIL while it enqueues), so unserialised callers do collide.
    ``cache_from`` is the timing cache this "TensorRT" accepts; any other non-empty one is a mismatch.

    INT8 as TensorRT takes it (explicit quantization): the parser accepts a Q/DQ graph only with signed int8 zero
    points of 0 and records how many Q/DQ nodes it parsed; an implicit-quantization calibrator raises; TensorRT 11
    (``version``) has no INT8 builder flag (networks are strongly typed).
    """
    import ctypes
    import threading
    import time

    import onnxruntime as ort

    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    major = int(version.split(".")[0])
    trt.calls, trt.violations, trt.engines = [], [], []
    rec = trt.calls.append
    trt.float32, trt.float16, trt.int32, trt.int8 = "float32", "float16", "int32", "int8"
    trt.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT", NONE="NONE")
    NUMPY = {"float32": np.float32, "float16": np.float16}

    class Logger:
        WARNING = 2

        def __init__(self, level):
            pass

    class Error:
        def node(self):
            return 7

        def node_name(self):
            return "node_MatMul_7"

        def node_operator(self):
            return "MatMul"

        def desc(self):
            return "unsupported data type"

    class Network:
        data = b""

    class Parser:
        num_errors = 0 if parse_ok else 1

        def __init__(self, network, logger):
            self.network = network

        def parse(self, data):
            import onnx
            from onnx import TensorProto, numpy_helper

            proto = onnx.load_model_from_string(data)
            values = {i.name: i for i in proto.graph.initializer}
            qdq = [n for n in proto.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
            for n in qdq:  # explicit quantization: symmetric int8 scales
                zero = values[n.input[2]]
                if zero.data_type != TensorProto.INT8 or numpy_helper.to_array(zero).any():
                    raise ContractError(f"{n.name}: TensorRT takes Q/DQ with int8 zero points of 0")
            rec(("parse", len(qdq)))
            self.network.data = data
            return parse_ok

        def get_error(self, i):
            return Error()

    class Cache:
        def __init__(self, data):
            self.data = data

        def serialize(self):
            return b"timing cache"

    class Config:
        def set_memory_pool_limit(self, pool, size):
            rec(("workspace", size))

        def set_flag(self, flag):
            if major >= 11 and flag == "INT8":
                raise AttributeError("TensorRT 11 has no INT8 builder flag")
            rec(("set_flag", flag))

        def clear_flag(self, flag):
            rec(("clear_flag", flag))

        def set_int8_calibrator(self, calibrator):
            raise ContractError("implicit quantization: an INT8 graph carries its own scales")

        def add_optimization_profile(self, profile):
            rec(("profile", profile.shapes))
            self.profile = profile.shapes

        def create_timing_cache(self, data):
            rec(("timing_cache_in", data))
            return Cache(data)

        def set_timing_cache(self, cache, ignore_mismatch):
            return ignore_mismatch or cache.data in (b"", cache_from)  # False: TensorRT rejected the cache

        def get_timing_cache(self):
            return Cache(b"")

    class Profile:
        def set_shape(self, name, *shapes):
            self.shapes = (name, *shapes)

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            rec(("create_network", flags))
            return Network()

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            return network.data  # the "engine" is the graph itself, run by ONNX Runtime below

    class Engine:
        def __init__(self, data: bytes):
            self.device = CURRENT_DEVICE["index"]  # the GPU it was deserialised on
            trt.engines.append(self)
            self.session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
            inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
            self.modes = {i.name: trt.TensorIOMode.INPUT for i in inputs} | {
                o.name: trt.TensorIOMode.OUTPUT for o in outputs
            }
            self.shapes = {t.name: tuple(d if isinstance(d, int) else -1 for d in t.shape) for t in inputs + outputs}
            self.num_io_tensors = len(self.modes)

        def get_tensor_name(self, i):
            return list(self.modes)[i]

        def get_tensor_mode(self, name):
            return self.modes.get(name, trt.TensorIOMode.NONE)

        def get_tensor_dtype(self, name):
            return trt.float32

        def create_execution_context(self):
            return Context(self)

    class Context:
        def __init__(self, engine: Engine):
            if CURRENT_DEVICE.get("index") != engine.device:
                raise ContractError("an execution context created on another GPU than its engine's")
            self.engine, self.input_shapes, self.addresses = engine, {}, {}
            engine.contexts = [*getattr(engine, "contexts", []), self]
            self.user: int | None = None  # the thread inside a set-shape → execute sequence

        def _enter(self, starts: bool = False) -> None:
            me = threading.get_ident()
            if self.user not in (None, me):
                trt.violations.append("context used by two threads at once")
                raise ContractError("IExecutionContext used by two threads at once")
            if starts:
                self.user = me

        def set_input_shape(self, name, shape):
            self._enter(starts=True)
            if self.engine.get_tensor_mode(name) != trt.TensorIOMode.INPUT:
                raise ContractError(f"set_input_shape on {name!r}, which is not an input tensor")
            fixed = self.engine.shapes[name]
            shape = tuple(int(d) for d in shape)
            if len(shape) != len(fixed) or any(f not in (-1, d) for f, d in zip(fixed, shape, strict=True)):
                return False
            if not profile[0] <= shape[0] <= profile[1]:
                return False
            self.input_shapes[name] = shape
            return True

        def get_tensor_shape(self, name):
            self._enter()
            shape = self.engine.shapes[name]
            if self.engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT:
                if len(self.input_shapes) < sum(m == "INPUT" for m in self.engine.modes.values()):
                    return shape  # -1 where dynamic: not known before the input shapes
                batch = next(iter(self.input_shapes.values()))[0]
                return (batch, *shape[1:])
            return self.input_shapes.get(name, shape)

        def set_tensor_address(self, name, address):
            self._enter()
            if name not in self.engine.modes:
                raise ContractError(f"set_tensor_address on unknown tensor {name!r}")
            if not isinstance(address, int) or address == 0:
                raise ContractError(f"set_tensor_address({name!r}) needs a device pointer, got {address!r}")
            self.addresses[name] = address
            return True

        def execute_async_v3(self, stream_handle):
            self._enter()
            if not isinstance(stream_handle, int):
                raise ContractError(f"execute_async_v3 needs a CUDA stream handle (int), got {stream_handle!r}")
            missing = [n for n in self.engine.modes if n not in self.addresses]
            missing += [n for n, m in self.engine.modes.items() if m == "INPUT" and n not in self.input_shapes]
            if missing:
                raise ContractError(f"execute_async_v3 before the shapes/addresses of {missing} were set")
            feeds = {}
            for name, shape in self.input_shapes.items():
                size = int(np.prod(shape)) * 4
                feeds[name] = np.frombuffer(ctypes.string_at(self.addresses[name], size), np.float32).reshape(shape)
            time.sleep(0.005)  # the real call releases the GIL while it enqueues
            outputs = [n for n, m in self.engine.modes.items() if m == "OUTPUT"]
            for name, value in zip(outputs, self.engine.session.run(outputs, feeds), strict=True):
                value = np.ascontiguousarray(value, NUMPY["float32"])
                ctypes.memmove(self.addresses[name], value.ctypes.data, value.nbytes)
            self.user = None
            return True

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, data):
            if CURRENT_DEVICE.get("index") is None:
                raise ContractError("deserialize_cuda_engine with no current CUDA device set")
            return Engine(bytes(data))

    trt.Logger, trt.OnnxParser, trt.Builder, trt.Runtime = Logger, Parser, Builder, Runtime
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE=0)
    trt.BuilderFlag = types.SimpleNamespace(TF32="TF32", **({"INT8": "INT8"} if major < 11 else {}))
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=1)
    return trt


CURRENT_DEVICE: dict[str, int | None] = {}


class HostStream:
    cuda_stream = 0x5EED  # a handle, as torch.cuda.Stream.cuda_stream is

    def __init__(self, device):
        self.device = device

    def synchronize(self):
        pass


def strict_cuda(monkeypatch, gpus: int = 8) -> None:
    """torch.cuda without a GPU, keeping its rules: set_device parses the device with torch's own helper, which
    raises for a device without an index, and refuses an index past the ``gpus`` there are (CUDA's "invalid device
    ordinal"); buffers live in host memory (their addresses are real)."""
    from torch.cuda._utils import _get_device_index

    import capserve.runtime.tensorrt_backend as backend

    def set_device(device) -> None:
        index = _get_device_index(device)
        if not 0 <= index < gpus:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} ({gpus} GPUs)")
        CURRENT_DEVICE.update(index=index)

    CURRENT_DEVICE.clear()
    monkeypatch.setattr(backend, "gpu_name", lambda device="cuda": "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "Stream", HostStream)
    monkeypatch.setattr(backend.CudaMemory, "scope", lambda self: __import__("contextlib").ExitStack())
    monkeypatch.setattr(backend.CudaMemory, "upload", lambda self, a, dtype: torch.from_numpy(a).to(dtype).clone())
    monkeypatch.setattr(backend.CudaMemory, "empty", lambda self, shape, dtype: torch.empty(shape, dtype=dtype))
    monkeypatch.setattr(backend.CudaMemory, "download", lambda self, t: t.float().numpy().copy())


def strict_onnxruntime_cuda(monkeypatch, gpus: int) -> list:
    """ONNX Runtime's CUDA execution provider on a machine without a GPU: a session asked for it records its
    ``device_id`` (refusing one past the ``gpus`` there are, as the real provider does) and runs on the CPU while
    reporting the CUDA provider in use. Returns the list of sessions created, in order."""
    import onnxruntime as ort

    sessions: list = []

    class CudaSession(ort.InferenceSession):
        def __init__(self, path, options=None, providers=None, **kwargs):
            self.device_id, self.requested = None, []
            for provider in providers or ["CPUExecutionProvider"]:
                name, provider_options = (provider, {}) if isinstance(provider, str) else provider
                if name == "CUDAExecutionProvider":
                    self.device_id = int(provider_options.get("device_id", 0))
                    if not 0 <= self.device_id < gpus:
                        raise RuntimeError(f"CUDA failure 101: invalid device ordinal; GPU={self.device_id}")
                self.requested.append(name)
            super().__init__(path, options, providers=["CPUExecutionProvider"], **kwargs)
            sessions.append(self)

        def get_providers(self):
            return [p for p in self.requested if p in ("CUDAExecutionProvider", "CPUExecutionProvider")]

    monkeypatch.setattr(ort, "InferenceSession", CudaSession)
    return sessions
