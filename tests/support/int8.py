"""Stand-ins for ONNX Runtime sessions whose timings and int8 outputs a test sets: what another CPU's int8 kernels
would measure and compute, on this machine's real sessions.

``stand_in_sessions`` replaces ``onnxruntime.InferenceSession`` with ``SessionStandIn``: a real session of the same
file (so every option, provider and input check of ONNX Runtime applies) whose ``run(output_names, input_feed,
run_options=None)`` checks its feeds against the graph's inputs as the real API does, advances a ``FakeClock`` by
the time the test gives per image for the graph's kind (``graph_kind``), and lets the test set an int8 graph's
logits: those of an fp32 graph (``answer_as``: int8 kernels that compute exactly, on any CPU), changed per kind
(``flip_every``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

KINDS = ("fp32", "u8s8", "u8s8-7bit", "s8s8")


def graph_kind(path: str | Path) -> str:
    """What an .onnx file is, read from its own tensors: ``fp32`` (no Q/DQ), ``s8s8`` (int8 activations),
    ``u8s8-7bit`` (uint8 activations, weights within ±64: ``reduce_range``) or ``u8s8``."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(path))
    values = {i.name: i for i in proto.graph.initializer}
    weights, activations = [], set()
    for node in proto.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in values:
            weights.append(int(np.abs(numpy_helper.to_array(values[node.input[0]]).astype(np.int32)).max()))
        elif node.op_type == "QuantizeLinear" and node.input[0] not in values and len(node.input) > 2:
            activations.add(numpy_helper.to_array(values[node.input[2]]).dtype)
    if not activations:
        return "fp32"
    if np.dtype(np.int8) in activations:
        return "s8s8"
    return "u8s8-7bit" if max(weights) <= 64 else "u8s8"


class FakeClock:
    """A monotonic clock that moves only when a stand-in session runs (``measure_speed``'s ``clock``)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def flip_every(k: int) -> Callable[[np.ndarray], np.ndarray]:
    """A change of an int8 graph's logits (B, C): every k-th image of each run gets its top two classes swapped,
    another decision, as kernels that round otherwise flip an image near a tie."""

    def change(logits: np.ndarray) -> np.ndarray:
        out = logits.copy()
        for i in range(0, len(out), k):
            top = np.argsort(out[i])[-2:]  # runner-up, top
            out[i, top] = out[i, top[::-1]]
        return out

    return change


class SessionStandIn:
    """A real ``onnxruntime.InferenceSession`` whose time per run and int8 logits the test sets."""

    def __init__(
        self,
        real: type,
        path: str,
        sess_options=None,
        providers=None,
        *,
        clock: FakeClock | None,
        seconds_per_image: dict[str, float],
        change: dict[str, Callable[[np.ndarray], np.ndarray]],
        answer_as: str | Path | None,
        **kwargs,
    ):
        self._session = real(path, sess_options, providers=providers, **kwargs)
        self.kind = graph_kind(path)
        self.clock, self.change = clock, change.get(self.kind)
        self.seconds = seconds_per_image.get(self.kind, 0.0)
        self._answer = None
        if answer_as is not None and self.kind != "fp32":
            self._answer = real(str(answer_as), sess_options, providers=providers, **kwargs)
        self.runs: list[int] = []  # batch sizes run

    def __getattr__(self, name: str):
        return getattr(self._session, name)  # get_inputs, get_outputs, get_providers, get_modelmeta, ...

    def run(self, output_names, input_feed, run_options=None):
        inputs = {i.name: i for i in self._session.get_inputs()}
        if set(input_feed) != set(inputs):
            raise ValueError(f"feeds {sorted(input_feed)} for inputs {sorted(inputs)}")
        known = {o.name for o in self._session.get_outputs()}
        if output_names is not None and not set(output_names) <= known:
            raise ValueError(f"outputs {output_names} not in {sorted(known)}")
        for name, array in input_feed.items():
            shape = inputs[name].shape
            if not isinstance(array, np.ndarray) or array.dtype != np.float32 or array.ndim != len(shape):
                raise TypeError(f"{name}: float32 array of rank {len(shape)} expected")
            if any(isinstance(d, int) and d != n for d, n in zip(shape, array.shape, strict=True)):
                raise ValueError(f"{name}: shape {array.shape} against {shape}")
        outputs = self._session.run(output_names, input_feed, run_options)
        if self._answer is not None:
            outputs = self._answer.run(output_names, input_feed, run_options)
        batch = len(next(iter(input_feed.values())))
        self.runs.append(batch)
        if self.clock is not None:
            self.clock.now += self.seconds * batch
        if self.change is not None:
            names = output_names or [o.name for o in self._session.get_outputs()]
            outputs = [self.change(o) if n == "logits" else o for n, o in zip(names, outputs, strict=True)]
        return outputs


def stand_in_sessions(
    monkeypatch,
    clock: FakeClock | None = None,
    seconds_per_image: dict[str, float] | None = None,
    change: dict[str, Callable[[np.ndarray], np.ndarray]] | None = None,
    answer_as: str | Path | None = None,
) -> list[SessionStandIn]:
    """Make every ``onnxruntime.InferenceSession`` opened from here on a ``SessionStandIn``: ``seconds_per_image``
    and ``change`` by graph kind, int8 graphs answering with ``answer_as``'s logits when given. Returns the list
    the sessions are added to."""
    import onnxruntime

    real = onnxruntime.InferenceSession
    opened: list[SessionStandIn] = []

    def open_session(path, sess_options=None, providers=None, **kwargs):
        session = SessionStandIn(
            real,
            str(path),
            sess_options,
            providers,
            clock=clock,
            seconds_per_image=seconds_per_image or {},
            change=change or {},
            answer_as=answer_as,
            **kwargs,
        )
        opened.append(session)
        return session

    monkeypatch.setattr(onnxruntime, "InferenceSession", open_session)
    return opened


def write_image_folder(root: Path, split: str, images: np.ndarray, classes: np.ndarray, labels) -> None:
    """``capserve train --data`` layout: ``root/split/<label>/<k>.png`` for uint8 images (N, C, H, W)."""
    from PIL import Image

    for k, (image, c) in enumerate(zip(images, classes, strict=True)):
        folder = root / split / labels[c]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image.transpose(1, 2, 0)).save(folder / f"{k:03d}.png")
