"""What this machine's CPU is, in one place: its model name and the instruction set torch dispatches to
(:func:`cpu_description`, written beside every figure: bench.json, the demo, the docs' tables), and whether it
computes a reduced-precision dtype natively (:func:`native_low_precision`, behind ``--precision``'s warning).

A figure measured on one CPU says little about another: a 2-core AVX2 EPYC runs bf16 3-10x slower than fp32
(it converts every element), a Sapphire Rapids with AMX runs it faster. Everything that reports a time or picks a
path by speed names the CPU with these."""
from __future__ import annotations

import functools
import os
import platform

__all__ = ["cpu_model", "cpu_isa", "cpu_description", "native_low_precision", "ISA_ENV", "isa_env", "isa_in_effect",
           "rerun_held_to"]

#: The CPU flags (``/proc/cpuinfo``) that compute each reduced-precision dtype natively: without one, oneDNN and
#: ATen emulate it by converting to float32 and back around every op.
NATIVE_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's ``/proc/cpuinfo`` fields; empty where there is none (macOS, Windows)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                out[key.strip()] = value.strip()
    except OSError:
        pass
    return out


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC", "Intel(R) Xeon(R) Platinum 8480+"), or the platform's processor."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine() or "unknown CPU"


def cpu_isa() -> str:
    """The instruction set torch's kernels dispatch to here ("AVX512", "AVX2", "DEFAULT"), as lowered by
    ``ATEN_CPU_CAPABILITY``; with ``ONEDNN_MAX_CPU_ISA`` set, that too."""
    import torch

    isa = torch.backends.cpu.get_cpu_capability()
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return f"{isa}, oneDNN {onednn}" if onednn else isa


def cpu_description() -> str:
    """One line naming this CPU for a figure: model, instruction set, cores ("AMD EPYC (AVX2), 2 cores")."""
    return f"{cpu_model()} ({cpu_isa()}), {os.cpu_count()} cores"


#: The instruction sets a run can be held to, by the variables torch (ATen), oneDNN and MKL read when they load:
#: ``native`` what the CPU has; ``avx512`` and ``avx2`` as a CPU with that much and no more; ``default`` torch's
#: unvectorized kernels (SSE). ``make test-isa`` and ``onnxfuse bench --isa`` read this table. ONNX Runtime
#: picks its kernels by the CPU alone (no setting).
ISA_ENV: dict[str, dict[str, str]] = {
    "native": {},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}
#: the CPU flags an instruction set needs (``/proc/cpuinfo``): ATen's AVX-512 kernels use F, BW, VL and DQ
_NEEDS = {"avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"), "avx2": ("avx2", "fma")}


def isa_env(isa: str) -> dict[str, str]:
    """The variables that hold torch, oneDNN and MKL to ``isa`` (a key of :data:`ISA_ENV`); a ``ConfigError`` for
    an unknown name or an instruction set this CPU lacks."""
    from onnxfuse.core.errors import ConfigError

    if isa not in ISA_ENV:
        raise ConfigError(f"isa: unknown instruction set '{isa}'; choose from: {', '.join(ISA_ENV)}")
    flags = set(_cpuinfo().get("flags", "").split())
    missing = [f for f in _NEEDS.get(isa, ()) if flags and f not in flags]
    if missing:
        raise ConfigError(f"isa: this CPU ({cpu_model()}) has no {isa.upper()} (its flags lack {', '.join(missing)});"
                          f" choose an instruction set it has, e.g. avx2 or default")
    return ISA_ENV[isa]


def isa_in_effect(isa: str) -> bool:
    """Whether this process's environment already holds the libraries to ``isa``."""
    return all(os.environ.get(k) == v for k, v in isa_env(isa).items())


def rerun_held_to(isa: str, script: str, argv: list[str] | None = None) -> int | None:
    """A script's run under ``isa``: None where this process is held to it already (go on here); else the script
    (its path, ``__file__``) run again with ``argv`` (default: this process's arguments) and :func:`isa_env`'s
    variables, which torch, oneDNN and MKL read when they load, and its exit status."""
    import subprocess
    import sys

    if isa_in_effect(isa):
        return None
    command = [sys.executable, os.path.abspath(script), *(argv or sys.argv[1:])]
    return subprocess.call(command, env={**os.environ, **isa_env(isa)})


def native_low_precision(dtype_name: str) -> bool:
    """Whether this CPU computes ``dtype_name`` ("bfloat16", "float16") natively, by its flags (:data:`NATIVE_FLAGS`).
    Where ``/proc/cpuinfo`` is missing, torch's own probe for AVX512-BF16 / AMX answers."""
    flags = set(_cpuinfo().get("flags", "").split())
    if flags:
        return any(f in flags for f in NATIVE_FLAGS[dtype_name])
    import torch

    if dtype_name == "bfloat16":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.cpu._is_amx_fp16_supported()
