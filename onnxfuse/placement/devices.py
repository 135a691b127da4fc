"""Devices a graph is placed on: memory, compute rate, and the link each one sends over.

A device runs one operator at a time (with its own intra-op threads) and sends over one outgoing link:

    compute(node, device) = measured_s / speed              (profiled costs; speed 1 = the profiling machine)
                          = max(flops / flops_rate, bytes / mem_bandwidth)   (estimated costs)
                            + op_overhead
    comm(bytes, src, dst) = 0                                if src == dst
                          = src.latency + bytes / src.bandwidth   otherwise
    a stage (one session call on a device) starts with call_overhead
    k devices of one host computing at once each run 1 + contention * (k - 1) times slower

Devices come from flags (``--devices 4 --memory 8GiB ...``: equal devices) or from a YAML file::

    defaults: {memory: 8GiB, flops: 20 TFLOP/s, bandwidth: 12 GB/s, latency: 10us}
    devices:
      - {name: gpu0, kind: cuda, device_id: 0}
      - {name: gpu1, kind: cuda, device_id: 1, memory: 4GiB}
      - {name: cpu, count: 2, flops: 200 GFLOP/s, threads: 1}    # count: that many equal devices

Sizes take B, KB, MB, GB (powers of 1000) and KiB, MiB, GiB (powers of 1024); rates FLOP/s, B/s with the same
prefixes (T, G, M, K); times s, ms, us, ns.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

from onnxfuse.core._units import parse_rate, parse_size, parse_time
from onnxfuse.core.errors import ConfigError, InputFileError

__all__ = ["DeviceSpec", "make_devices", "load_device_spec", "parse_size", "parse_rate", "parse_time", "comm_time",
           "format_bytes", "size_flag", "replace_all", "DEVICE_FIELDS"]


@dataclass(frozen=True)
class DeviceSpec:
    """One device. Defaults describe one core of a modern x86 CPU talking to its peers through host memory."""

    name: str = "cpu0"
    kind: str = "cpu"            # "cpu" or "cuda": which onnxruntime execution provider runs its part
    device_id: int = 0           # CUDA device id (kind "cuda")
    threads: int = 1             # intra-op threads of its onnxruntime session (kind "cpu")
    memory: float = math.inf     # bytes
    flops: float = 5e10          # FLOP/s, for estimated costs
    mem_bandwidth: float = 1e10  # bytes/s, for estimated costs of memory-bound operators
    speed: float = 1.0           # multiplies the speed of profiled costs (2.0: twice as fast as the profiled machine)
    bandwidth: float = 5e9       # bytes/s of its outgoing link
    latency: float = 2e-5        # seconds per transfer on its outgoing link
    op_overhead: float = 0.0     # seconds added to every operator (dispatch outside the kernel)
    call_overhead: float = 0.0   # seconds added to every stage (one session call)
    host: str = ""               # devices naming the same host share its cores and memory bandwidth ...
    contention: float = 0.0      # ... and run 1 + contention * (k - 1) times slower while k of them compute

    def __post_init__(self) -> None:
        for f in ("memory", "flops", "mem_bandwidth", "speed", "bandwidth"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"device '{self.name}': {f} must be positive, got {getattr(self, f)}")
        for f in ("latency", "op_overhead", "call_overhead", "contention"):
            if getattr(self, f) < 0:
                raise ConfigError(f"device '{self.name}': {f} must not be negative, got {getattr(self, f)}")
        if self.kind not in ("cpu", "cuda"):
            raise ConfigError(f"device '{self.name}': kind must be 'cpu' or 'cuda', got '{self.kind}'")
        if self.threads < 1:
            raise ConfigError(f"device '{self.name}': threads must be at least 1, got {self.threads}")

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        if math.isinf(self.memory):
            d["memory"] = None
        return d


DEVICE_FIELDS = {f.name for f in dataclasses.fields(DeviceSpec)}

_PARSERS = {"memory": parse_size, "flops": parse_rate, "mem_bandwidth": parse_rate, "bandwidth": parse_rate,
            "latency": parse_time, "op_overhead": parse_time, "call_overhead": parse_time, "speed": float,
            "threads": int, "device_id": int, "name": str, "kind": str, "host": str, "contention": float}


def _device_fields(entry: dict, where: str) -> dict:
    """Parse one YAML/flag mapping of device fields (units allowed) into DeviceSpec keyword arguments."""
    out = {}
    for key, value in entry.items():
        if key == "count":
            continue
        if key not in _PARSERS:
            raise ConfigError(f"{where}: unknown device field '{key}' (known: count, {', '.join(sorted(_PARSERS))})")
        try:
            out[key] = _PARSERS[key](value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: field '{key}' = {value!r} is not valid ({e})") from None
    return out


def make_devices(count: int, **fields: Any) -> list[DeviceSpec]:
    """``count`` equal devices named cpu0.. (or cuda0.. for kind 'cuda', with device ids 0..count-1)."""
    if count < 1:
        raise ConfigError(f"devices: must be at least 1, got {count}")
    f = _device_fields(fields, "device flags")
    kind = f.get("kind", "cpu")
    return [DeviceSpec(**{**f, "name": f"{kind}{d}", **({"device_id": d} if kind == "cuda" else {})})
            for d in range(count)]


def load_device_spec(path: str | os.PathLike, count: int | None = None) -> list[DeviceSpec]:
    """Devices from a YAML file (see the module docstring). ``count`` (from --devices) must match it when given;
    a file with only ``defaults`` (and ``count``) describes that many equal devices."""
    import yaml

    path = os.fspath(path)
    if not os.path.exists(path):
        raise InputFileError(f"device spec '{path}' does not exist")
    try:
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise InputFileError(f"device spec '{path}' is not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"device spec '{path}': expected a mapping with 'devices' and/or 'defaults'")
    unknown = set(doc) - {"defaults", "devices", "count"}
    if unknown:
        raise ConfigError(f"device spec '{path}': unknown key '{sorted(unknown)[0]}' (use defaults, devices, count)")
    defaults = doc.get("defaults") or {}
    entries = doc.get("devices")
    if entries is None:
        n = int(doc.get("count") or count or 0)
        if n < 1:
            raise ConfigError(f"device spec '{path}' lists no devices: add a 'devices' list or 'count'")
        entries = [{} for _ in range(n)]
    devices: list[DeviceSpec] = []
    for k, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ConfigError(f"device spec '{path}': devices[{k}] must be a mapping of fields")
        repeat = int(entry.get("count", 1))
        fields = {**_device_fields(defaults, f"{path} defaults"), **_device_fields(entry, f"{path} devices[{k}]")}
        for r in range(repeat):
            name = fields.get("name", f"{fields.get('kind', 'cpu')}{len(devices)}")
            if repeat > 1:
                name = f"{name}{r}" if "name" in fields else name
            devices.append(DeviceSpec(**{**fields, "name": name}))
    if count is not None and count != len(devices):
        raise ConfigError(f"count={count} but device spec '{path}' describes {len(devices)} devices; "
                          "drop count= or make them agree")
    names = [d.name for d in devices]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise ConfigError(f"device spec '{path}': device name '{dup}' is used twice")
    return devices


def comm_time(nbytes: float, src: DeviceSpec, dst: DeviceSpec) -> float:
    """Seconds to move ``nbytes`` from ``src`` to ``dst``: latency + bytes / bandwidth of src's link (0 on one
    device)."""
    if src is dst or src.name == dst.name:
        return 0.0
    return src.latency + nbytes / src.bandwidth


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    if math.isinf(n):
        return "unlimited"
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{int(n)} B"


def size_flag(n: float) -> str:
    """A --memory value at least ``n`` bytes, in the largest unit that keeps it >= 1: 1066000 -> '1.02MiB'."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{math.ceil(n / scale * 100) / 100:g}{unit}"
    return f"{math.ceil(n)}B"


def replace_all(devices: Sequence[DeviceSpec], **fields: Any) -> list[DeviceSpec]:
    """The same devices with some fields set on every one (e.g. calibrated overheads)."""
    return [dataclasses.replace(d, **fields) for d in devices]
