"""ONNX ops as torch callables: one small builder per op type, registered in ``OPS`` (op type -> builder, a
:class:`~onnxfuse.core.registry.Registry`), one module per op family as the fusion rules are (``core/rules/``).

A builder runs once, when a graph is converted (``torch_graph.OnnxModule``). It reads the node's attributes and the
inputs that are constants (a Reshape target, Slice starts, Clip bounds...) from a :class:`NodeSpec` and returns a
:class:`Kernel`: a callable over torch tensors and the indices of the node inputs it takes at run time. The forward
pass therefore parses nothing: it calls ``kernel.fn(*tensors)``. A kernel returns one tensor, or a tuple with one
entry per node output.

Covered: every op the fusion rules emit or accept (``onnxfuse.core.rules.RULES``; a per-model fallback copies source
nodes verbatim) and every op the load passes emit, in opsets 13..20, including the forms that changed in that range
(axes as attribute or input, Split sizes as input or ``num_outputs``, Resize 13/18/19, BatchNormalization 9/14/15).
float32 data, and the int64/bool shape arithmetic around it. Shape-like inputs that are not constants are read with
``.tolist()``; ``torch_graph`` keeps shape arithmetic on the host, so that is no device synchronisation.

Adding an op = one ``@op("OpType")`` builder in its family's module and one test in tests/runtime/torch/test_kernels.py.
"""
from __future__ import annotations

# the family modules register their builders in OPS when imported
from onnxfuse.runtime.torch.kernels import (control_flow, conv, detection, elementwise, gather, gemm,  # noqa: F401
                                            generators, norm, pool, quantize, random, recurrent, reduce, resize,
                                            shape, signal, slicing, softmax, sort)
from onnxfuse.runtime.torch.kernels._base import (HOST_OPS, OPS, RANDOM_OPS, Kernel, NodeSpec, RandomStreams,
                                                  SubProgram, TorchOptions, UnsupportedTorchOpError, autocast_lowered,
                                                  node_outputs, op, supported_ops, torch_dtype)
from onnxfuse.runtime.torch.kernels.gemm import folded_matmul

# The default-domain operators with no kernel here, by family, and why: none of them can sit in a graph that trains.
EXCLUDED_FAMILIES: dict[str, str] = {
    "strings": "torch has no string tensors, and text is tokenized before a model sees it",
    "image bytes": "decoding encoded images happens in the data pipeline, before the model",
    "sequences and optionals": "values of other types than tensors, which no fusion rule lays out and torch's "
                               "exporters write only for scripted control flow",
    "integer-quantized products": "inference kernels of an already quantized model, whose integer outputs no "
                                  "gradient flows through (quantization-aware training exports QuantizeLinear -> "
                                  "DequantizeLinear, which trains: FakeQuantize)",
}
EXCLUDED: dict[str, str] = {  # op type -> its family in EXCLUDED_FAMILIES
    **dict.fromkeys(("RegexFullMatch", "StringConcat", "StringNormalizer", "StringSplit", "TfIdfVectorizer"),
                    "strings"),
    "ImageDecoder": "image bytes",
    **dict.fromkeys(("SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase", "SequenceInsert",
                     "SequenceLength", "SequenceMap", "ConcatFromSequence", "SplitToSequence", "Optional",
                     "OptionalGetElement", "OptionalHasElement"), "sequences and optionals"),
    **dict.fromkeys(("ConvInteger", "MatMulInteger", "QLinearConv", "QLinearMatMul", "DynamicQuantizeLinear"),
                    "integer-quantized products"),
}

__all__ = ["OPS", "op", "Kernel", "NodeSpec", "RandomStreams", "SubProgram", "node_outputs", "TorchOptions",
           "UnsupportedTorchOpError", "supported_ops", "torch_dtype", "HOST_OPS", "RANDOM_OPS", "autocast_lowered",
           "folded_matmul", "EXCLUDED", "EXCLUDED_FAMILIES"]
