"""If, Loop and Scan: refused in one line (no fusion rule accepts subgraphs)."""
from __future__ import annotations

from onnxfuse.runtime.torch.kernels._base import Kernel, NodeSpec, op


@op("If", "Loop", "Scan")
def control_flow(spec: NodeSpec) -> Kernel:
    spec.fail("control flow (subgraphs) is not supported by the torch runtime, and no fusion rule accepts it",
              "export the model without data-dependent control flow, or train this array with --runtime ort")
    raise AssertionError  # unreachable
