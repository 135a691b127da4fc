"""An onnxruntime session for a model on one device: what profiling, shape measurement and the pipeline runner
share. onnxruntime is imported inside: the placement data model (graph, devices, costs, placers) never needs it.
"""
from __future__ import annotations

import onnx

from onnxfuse.core.errors import ORT_CUDA_FIX, PlacementError
from onnxfuse.placement.devices import DeviceSpec

__all__ = ["make_session"]


def make_session(model: onnx.ModelProto, device: DeviceSpec | None = None, profile_prefix: str | None = None):
    """An onnxruntime InferenceSession for ``model`` on ``device`` (default: one CPU thread), optimizations off."""
    import onnxruntime as ort

    device = device or DeviceSpec()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.intra_op_num_threads = device.threads
    so.inter_op_num_threads = 1
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    if device.kind == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise PlacementError(f"device '{device.name}' is a CUDA device but this onnxruntime has no "
                                 f"CUDAExecutionProvider; {ORT_CUDA_FIX}, or use cpu devices")
        providers = [("CUDAExecutionProvider", {"device_id": device.device_id}), "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    try:
        return ort.InferenceSession(model.SerializeToString(), so, providers=providers)
    except Exception as e:
        raise PlacementError(f"onnxruntime cannot load the sub-model '{model.graph.name}' for device "
                             f"'{device.name}': {' '.join(str(e).split())[:300]}") from e
