"""The inference runtimes on the CPU, timed beside eager deformconv on the same float32
tensors with torch's thread count: each op's ONNX export in both sampling forms
(deformconv.decompositions.SAMPLING_FORMS: GridSample, or the gather form without it) in ONNX
Runtime and OpenVINO, and for DCN v1/v2 also ONNX Runtime's own DeformConv kernel (a one-node
model). Each runtime that is not installed is left out."""

import importlib.metadata
import importlib.util
import tempfile
from typing import Callable, Dict, Optional, Sequence

import torch

from deformconv.decompositions import SAMPLING_FORMS

from .shapes import Shape


def _onnxruntime_session(model):
    """An ONNX Runtime CPU session of the ONNX model (bytes or a path) with torch's thread
    count."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    # Its pool's threads would otherwise spin for a while after each run, taking the cores from
    # the contender timed next.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _deform_conv_node_model(shape: Shape, names, values) -> bytes:
    """DCN v1/v2 of `shape` as ONNX's one DeformConv node (opset 19)."""
    from onnx import TensorProto, helper

    node = helper.make_node(
        "DeformConv", names, ["Y"], kernel_shape=[shape.kernel, shape.kernel],
        strides=[shape.stride] * 2, pads=[shape.padding] * 4, dilations=[1, 1],
        group=shape.groups, offset_group=shape.offset_groups)
    graph = helper.make_graph(
        [node], "deform_conv",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, list(value.shape))
         for name, value in zip(names, values)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    # IR version 9 is the one of opset 19, which every onnxruntime since 1.15 reads.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    return model.SerializeToString()


class _FloatOperands(torch.nn.Module):
    """run(*inputs) as a module of the floating-point inputs alone, for the exporters; the
    others (multi-scale deformable attention's levels) held as buffers, constants of the
    graph, as the levels of a model deployed at one image size are; None ones (DCN's absent
    mask) passed as None."""

    def __init__(self, run: Callable, inputs: Sequence[Optional[torch.Tensor]]):
        super().__init__()
        self.run = run
        self.kinds = []
        for index, tensor in enumerate(inputs):
            if tensor is None:
                self.kinds.append("none")
            elif tensor.is_floating_point():
                self.kinds.append("operand")
            else:
                self.kinds.append(f"held_{index}")
                self.register_buffer(f"held_{index}", tensor)

    def forward(self, *operands):
        remaining = iter(operands)
        inputs = [None if kind == "none" else next(remaining) if kind == "operand"
                  else getattr(self, kind) for kind in self.kinds]
        return self.run(*inputs)


def installed() -> bool:
    """Whether ONNX Runtime and the exporter's onnxscript are (OpenVINO is optional)."""
    return all(importlib.util.find_spec(name) is not None
               for name in ("onnx", "onnxruntime", "onnxscript"))


def versions() -> Dict[str, str]:
    """The versions of the runtimes installed, for the report's setup."""
    found = {}
    for package in ("onnxruntime", "openvino"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def form_forwards(run: Callable, inputs: Sequence[Optional[torch.Tensor]],
                  deform_conv_node: Optional[Shape] = None) -> Dict[str, Callable[[], object]]:
    """{runtime: forward} of run(*inputs), an op of deformconv's, exported to ONNX in each
    sampling form (DCN v1/v2 in its standard form) and loaded in ONNX Runtime and, where
    installed, OpenVINO ("onnxruntime gather form", "openvino grid_sample form", ...); with
    deform_conv_node, DCN v1/v2 of that shape also as ONNX Runtime's DeformConv node
    ("onnxruntime"), on inputs (x, offset, weight, bias, mask). Each forward returns the output
    as a NumPy array. Empty where ONNX Runtime is not installed."""
    if not installed():
        return {}
    import numpy as np

    import deformconv.onnx
    try:
        import openvino
    except ImportError:
        openvino = None
    module = _FloatOperands(run, inputs).eval()
    operands = [t.detach() for t, kind in zip(inputs, module.kinds) if kind == "operand"]
    feeds = [np.ascontiguousarray(t.numpy()) for t in operands]
    forwards = {}
    if deform_conv_node is not None:
        x, offset, weight, bias, mask = inputs
        names = ["X", "W", "offset", "B"] + (["mask"] if mask is not None else [])
        values = [x, weight, offset, bias] + ([mask] if mask is not None else [])
        node_feeds = {name: np.ascontiguousarray(value.detach().numpy())
                      for name, value in zip(names, values)}
        node_session = _onnxruntime_session(_deform_conv_node_model(deform_conv_node, names,
                                                                    values))
        forwards["onnxruntime"] = lambda: node_session.run(None, node_feeds)[0]
    with tempfile.TemporaryDirectory() as folder:
        for form in SAMPLING_FORMS:
            # Both runtimes read the file whole when they load it.
            path = f"{folder}/{form}.onnx"
            deformconv.onnx.export_onnx(module, tuple(operands), path,
                                        deform_conv2d_form="standard", sampling_form=form,
                                        verbose=False)
            forwards[f"onnxruntime {form} form"] = _session_forward(
                _onnxruntime_session(path), feeds)
            if openvino is not None:
                # In float32: its CPU plugin computes in bfloat16 where the CPU has it, unless
                # told otherwise.
                core = openvino.Core()
                compiled = core.compile_model(
                    core.read_model(path), "CPU",
                    {"INFERENCE_PRECISION_HINT": "f32",
                     "INFERENCE_NUM_THREADS": torch.get_num_threads()})
                request = compiled.create_infer_request()
                forwards[f"openvino {form} form"] = (
                    lambda request=request: request.infer(feeds)[0])
    return forwards


def _session_forward(session, feeds) -> Callable[[], object]:
    names = [i.name for i in session.get_inputs()]
    named = dict(zip(names, feeds))
    return lambda: session.run(None, named)[0]


RUNTIMES = ("onnxruntime", *(f"{runtime} {form} form" for runtime in ("onnxruntime", "openvino")
                             for form in SAMPLING_FORMS))
