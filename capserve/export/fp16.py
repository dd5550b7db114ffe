"""FP16 ONNX graphs by graph surgery: FP16 weights and compute, LayerNormalization and Softmax kept in FP32.

TensorRT 11 has no FP16 builder flag (networks are strongly typed: precision comes from the graph), and an
FP16 LayerNorm overflows, so the precision is chosen here, op by op:

- every float initializer, Constant and Cast-to-float becomes FP16;
- the ops in ``KEEP_FP32`` get their inputs cast to FP32 and their outputs cast back (their own weights,
  e.g. LayerNorm's scale and bias, stay FP32 initializers);
- graph inputs and outputs stay FP32 (a Cast after each input and before each output), so a runtime feeds
  and reads an FP16 graph exactly like the FP32 one.

Tolerance, against eager FP32: max |Δlogit| <= ``FP16_ATOL + FP16_RTOL · max |logit|`` and max |Δprobability| <=
``FP16_PROB_ATOL``. The relative term is there because a model whose class poses are near-constant before their
LayerNorm amplifies any rounding; docs/benchmarks/runtimes.md has the measured errors of the named models.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

KEEP_FP32 = ("LayerNormalization", "Softmax")
FP16_ATOL = 2e-2
FP16_RTOL = 1e-1
FP16_PROB_ATOL = 2e-3
FP16_MAX = 65504.0


def convert_to_fp16(model: Any, keep_fp32: Iterable[str] = KEEP_FP32) -> Any:
    """An FP16 copy of an FP32 ``onnx.ModelProto`` with the ``keep_fp32`` op types computed in FP32.

    Raises:
        ValueError: the graph has subgraphs (Loop/If) or tensors whose type cannot be inferred.
    """
    import onnx

    keep = set(keep_fp32)
    g = _typed_graph(model)
    tensors = _Tensors(g)
    fp32_inits = _fp32_initializers(g, keep)
    initializers = _fp16_initializers(g, fp32_inits)
    nodes = _fp16_nodes(g, tensors, keep, fp32_inits)

    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:], out.graph.initializer[:], out.graph.value_info[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(initializers)
    try:
        onnx.shape_inference.infer_shapes(out, strict_mode=True)
    except onnx.shape_inference.InferenceError as e:  # a bug here, not the user's
        raise AssertionError(f"FP16 conversion produced an inconsistent graph: {e}") from e
    return out


def _typed_graph(model: Any) -> Any:
    """``model``'s graph with every tensor's type inferred (``ValueError`` when one cannot be, or for a subgraph)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except onnx.shape_inference.InferenceError as e:
        raise ValueError(f"cannot convert to FP16: type inference failed ({e})") from e
    g = inferred.graph
    for node in g.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise ValueError(f"cannot convert to FP16: node {node.name!r} ({node.op_type}) has a subgraph")
    return g


class _Tensors:
    """The tensor names of a typed graph as the conversion rewrites them: which are FP32, fresh names for the casts
    it adds, the FP16 twins of float graph inputs and outputs, and the FP32 casts of FP16 tensors."""

    def __init__(self, g: Any):
        self.dtype = {vi.name: vi.type.tensor_type.elem_type for vi in (*g.input, *g.output, *g.value_info)}
        self.dtype.update({init.name: init.data_type for init in g.initializer})
        self.taken = set(self.dtype) | {o for n in g.node for o in n.output}
        self.rename: dict[str, str] = {}  # graph inputs/outputs → their FP16 twin inside the graph
        self.as_fp32: dict[str, str] = {}  # FP16 tensor → its FP32 cast, shared by all FP32 consumers

    def is_float(self, name: str) -> bool:
        from onnx import TensorProto

        return bool(name) and self.dtype.get(name) == TensorProto.FLOAT

    def fresh(self, name: str, suffix: str) -> str:
        new = f"{name}_{suffix}"
        while new in self.taken:
            new += "_"
        self.taken.add(new)
        return new


def _cast(src: str, dst: str, to: int) -> Any:
    from onnx import helper

    return helper.make_node("Cast", [src], [dst], to=to, name=f"{dst}_cast")


def _fp32_initializers(g: Any, keep: set[str]) -> set[str]:
    """The float initializers read only by ``keep`` ops: they stay FP32 (LayerNorm's scale and bias must match its
    input's type)."""
    from onnx import TensorProto

    consumers: dict[str, list[Any]] = defaultdict(list)
    for node in g.node:
        for name in node.input:
            consumers[name].append(node)
    return {
        i.name
        for i in g.initializer
        if i.data_type == TensorProto.FLOAT and consumers[i.name] and all(c.op_type in keep for c in consumers[i.name])
    }


def _fp16_initializers(g: Any, fp32_inits: set[str]) -> list[Any]:
    """The graph's initializers, the float ones outside ``fp32_inits`` in FP16."""
    from onnx import TensorProto, numpy_helper

    initializers = []
    for init in g.initializer:
        if init.data_type == TensorProto.FLOAT and init.name not in fp32_inits:
            init = numpy_helper.from_array(_half(numpy_helper.to_array(init)), init.name)
        initializers.append(init)
    return initializers


def _fp16_nodes(g: Any, tensors: _Tensors, keep: set[str], fp32_inits: set[str]) -> list[Any]:
    """The graph's nodes in FP16 (``_fp16_node``), after a Cast to FP16 of each float graph input and before a Cast
    to FP32 of each float graph output."""
    from onnx import TensorProto

    nodes = []
    for inp in g.input:
        if tensors.is_float(inp.name):
            tensors.rename[inp.name] = tensors.fresh(inp.name, "fp16")
            nodes.append(_cast(inp.name, tensors.rename[inp.name], TensorProto.FLOAT16))
    float_outputs = [o.name for o in g.output if tensors.is_float(o.name)]
    for name in float_outputs:
        tensors.rename[name] = tensors.fresh(name, "fp16")
    for old in g.node:
        nodes.extend(_fp16_node(old, tensors, keep, fp32_inits))
    nodes.extend(_cast(tensors.rename[name], name, TensorProto.FLOAT) for name in float_outputs)
    return nodes


def _fp16_node(old: Any, tensors: _Tensors, keep: set[str], fp32_inits: set[str]) -> list[Any]:
    """``old`` on the renamed tensors: a ``keep`` op between casts of its float inputs to FP32 (the first such cast
    of a tensor is made here) and of its float outputs back to FP16; any other op with FP16 attributes."""
    import onnx
    from onnx import TensorProto

    node = onnx.NodeProto()
    node.CopyFrom(old)
    node.input[:] = [tensors.rename.get(n, n) for n in old.input]
    node.output[:] = [tensors.rename.get(n, n) for n in old.output]
    if old.op_type not in keep:
        _attributes_to_fp16(node)
        return [node]
    before, after = [], []
    for k, name in enumerate(old.input):
        if tensors.is_float(name) and name not in fp32_inits:
            current = node.input[k]
            if current not in tensors.as_fp32:
                tensors.as_fp32[current] = tensors.fresh(current, "fp32")
                before.append(_cast(current, tensors.as_fp32[current], TensorProto.FLOAT))
            node.input[k] = tensors.as_fp32[current]
    for k, name in enumerate(old.output):
        if tensors.is_float(name):
            current = node.output[k]
            node.output[k] = tensors.fresh(current, "fp32")
            after.append(_cast(node.output[k], current, TensorProto.FLOAT16))
    return [*before, node, *after]


def _half(array: np.ndarray) -> np.ndarray:
    if array.size and np.abs(array).max() > FP16_MAX:
        raise ValueError(
            f"a weight reaches {np.abs(array).max():.3g}, beyond FP16's range ({FP16_MAX}); export this model in FP32"
        )
    return array.astype(np.float16)


def _attributes_to_fp16(node: Any) -> None:
    """Constants and casts that make FP32 tensors make FP16 ones instead."""
    from onnx import TensorProto, numpy_helper

    for attr in node.attribute:
        if attr.name in ("to", "dtype") and attr.i == TensorProto.FLOAT:
            attr.i = TensorProto.FLOAT16
        elif attr.name in ("value", "value_float", "value_floats") and node.op_type in ("Constant", "ConstantOfShape"):
            if attr.name == "value" and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(numpy_helper.from_array(_half(numpy_helper.to_array(attr.t)), attr.t.name))
            elif attr.name != "value":  # value_float(s) are FP32 by definition: rewrite as an FP16 tensor
                values = np.array(attr.f if attr.name == "value_float" else list(attr.floats), dtype=np.float32)
                attr.Clear()
                attr.name, attr.type = "value", attr.TENSOR
                attr.t.CopyFrom(numpy_helper.from_array(_half(values.reshape(() if values.size == 1 else -1))))
