"""The device a run trains on, as one value: ``Device.parse("cuda:1")`` once at the edge (a flag, a config key, an
argument of the Python API), then the same :class:`Device` everywhere.

    str(d)            "cpu", "cuda" or "cuda:1", as it was written (what records and messages show)
    d.torch()         the torch.device (torch imported only then)
    d.ort_provider()  ONNX Runtime's execution provider for it: ("CPUExecutionProvider", {}) or
                      ("CUDAExecutionProvider", {"device_id": N})
    d.available()     None, or why torch cannot use it, with the fix (asked once per device and process)

A runtime asks about its own stack (``RUNTIMES[...].load().unavailable(device)``: ONNX Runtime's CUDA provider is a
question for ``runtime/ort/trainer.py``, which may import onnxruntime; this layer may not). Not to be confused with
``placement.devices.DeviceSpec``, a device *described* (memory, speed, links) that placement simulates.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from onnxfuse.core.errors import TORCH_CUDA_FIX, ConfigError

__all__ = ["Device", "DEVICE_TAKES", "CPU"]

DEVICE_TAKES = "cpu, cuda or cuda:N"  # what a device is written as (N: a CUDA device index >= 0)
_FORM = re.compile(r"(cpu|cuda)(?::(\d+))?")


@dataclass(frozen=True)
class Device:
    """``kind`` "cpu" or "cuda"; ``index`` N of cuda:N (None: plain "cuda", torch's current CUDA device, 0)."""

    kind: str
    index: int | None = None

    @classmethod
    def parse(cls, text: object, where: str = "") -> "Device":
        """The one parser of a device's text; anything else is one ConfigError line, the same wherever it was
        written (``where`` begins it: ``"--device: "``)."""
        m = _FORM.fullmatch(text) if isinstance(text, str) else None
        if m is None or (m.group(1) == "cpu" and m.group(2) is not None):
            raise ConfigError(f"{where}device = {text!r} must be {DEVICE_TAKES}")
        return cls(m.group(1), None if m.group(2) is None else int(m.group(2)))

    @classmethod
    def of(cls, device: "Device | str", where: str = "") -> "Device":
        """``device`` as a Device: one given is used as it is, a string is parsed (the Python API's edge)."""
        return device if isinstance(device, Device) else cls.parse(device, where)

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def device_id(self) -> int:
        """The CUDA device index (plain "cuda" is device 0, as torch and ONNX Runtime take it); 0 on the CPU."""
        return self.index or 0

    def torch(self):
        """This device as a ``torch.device``."""
        import torch

        return torch.device(str(self))

    def ort_provider(self) -> tuple[str, dict]:
        """ONNX Runtime's execution provider for this device and its options."""
        if self.is_cuda:
            return "CUDAExecutionProvider", {"device_id": self.device_id}
        return "CPUExecutionProvider", {}

    def ort_providers(self) -> list:
        """The providers of a session on this device: CUDA first (the CPU for the ops it has no kernel of)."""
        name, options = self.ort_provider()
        return [(name, options), "CPUExecutionProvider"] if self.is_cuda else [name]

    def available(self) -> str | None:
        """None when torch can use this device; else why not and what to do (one line)."""
        return _torch_unavailable(self)


@functools.lru_cache(maxsize=None)  # which CUDA devices torch sees does not change while a process runs
def _torch_unavailable(device: Device) -> str | None:
    if not device.is_cuda:
        return None
    import torch

    if not torch.cuda.is_available():
        return (f"--device {device}: this torch ({torch.__version__}) sees no CUDA device; {TORCH_CUDA_FIX}, "
                "or use --device cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        return f"--device {device}: torch sees {count} CUDA device(s) (cuda:0 .. cuda:{count - 1}); use one of them"
    return None


CPU = Device("cpu")
