"""Python parameters as the command line's flags, in one place.

The library's messages name the parameter a value came from as Python does: ``strategy: unknown form 'x'`` (the
parameter a message is about, first), ``which='best'``, ``pass initial=True``. The command prints them with its
flags: ``--strategy: unknown form 'x'``, ``--which best``, ``pass --initial``. ``FLAGS`` maps each parameter a
message of the library may name to the flag that sets it; :func:`as_flags` rewrites a message: ``name:`` at its
start, and ``name=`` anywhere but inside a call (``split_array(like=...)`` stays); a message that already names the
flag (``batch_size=32 (--batch-size 32)``) is left as it is, and a bare word is never rewritten.
"""
from __future__ import annotations

import logging
import re

__all__ = ["FLAGS", "COMMAND_FLAGS", "as_flags", "one_line", "FlagFormatter"]

# parameter -> flag, for the parameters the messages of onnxfuse/core, exporters, measure and placement name
FLAGS = {
    # fuse
    "strategy": "--strategy", "per_model_inputs": "--per-model-inputs", "padding_rows": "--padding-rows",
    "frozen": "--frozen", "batch": "--batch",
    # export
    "count": "--count", "seeds": "--seeds", "opset": "--opset", "input_shape": "--input-shape",
    "input_dtype": "--input-dtype", "factory_args": "--args",
    # train and split
    "resume": "--resume", "keep_best": "--keep-best", "eval_data": "--eval-data", "eval_fraction": "--eval-fraction",
    "which": "--which", "initial": "--initial", "like": "--like", "allow_missing": "--allow-missing",
    "overwrite": "--overwrite",
    # bench and plan
    "models": "--models", "modes": "--modes", "precisions": "--precision", "steps": "--steps", "rounds": "--rounds",
    "warmup": "--warmup", "budget_s": "--budget-s", "threads": "--threads", "device": "--device",
    "memory_budget": "--memory-budget", "max_B": "--max-B", "probe": "--probe",
    # place
    "devices": "--devices", "orders": "--order", "placers": "--placer", "costs": "--costs", "repeats": "--repeats",
    "calibrate": "--calibrate", "optimizer": "--optimizer", "batch_size": "--batch-size",
    "feeds": "--inputs", "dims": "--dims", "memory": "--memory",
    # more than one command
    "runtime": "--runtime", "strict": "--strict", "data": "--data",
}
# a parameter whose flag depends on the command (load_device_spec's count is place's --devices)
COMMAND_FLAGS = {"place": {"count": "--devices"}}
# a parameter named only as a message's subject (``B: ...``): B=4 in a sentence is an array size, not a flag
SUBJECT_FLAGS = {"B": "--B"}

# name=VALUE: VALUE quoted ('per-model'), a list (['a', 'b']), a mapping ({'N': 32}), a bare word (0, True,
# MODULE:FACTORY) or none (eval_data=)
_VALUE = r"(?:'([^'\n]*)'|\"([^\"\n]*)\"|\[([^\]\n]*)\]|\{([^}\n]*)\}|([\w.:/+-]*\w))?"


def _unquoted(text: str) -> str:
    return text.strip().strip("'\"")


def _value(m: re.Match) -> str | None:
    """A ``name=VALUE``'s value as a command line takes it: quotes dropped, a list comma-separated, a mapping
    ``N=32,S=16``."""
    quoted, double, listed, mapping, bare = m.group(2, 3, 4, 5, 6)
    if listed is not None:
        return ",".join(_unquoted(v) for v in listed.split(",") if v.strip())
    if mapping is not None:
        pairs = [item.split(":", 1) for item in mapping.split(",") if ":" in item]
        return ",".join(f"{_unquoted(k)}={_unquoted(v)}" for k, v in pairs)
    value = next((v for v in (quoted, double, bare) if v is not None), None)
    return f"'{value}'" if value and any(c.isspace() for c in value) else value


def as_flags(message: str, command: str | None = None) -> str:
    """``message`` with its parameters as ``command``'s flags (``name=True``: the flag alone)."""
    flags = {**FLAGS, **COMMAND_FLAGS.get(command or "", {})}
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))

    def subject(m: re.Match) -> str:
        flag = {**flags, **SUBJECT_FLAGS}[m.group(1)]
        return m.group(0) if flag in message else flag + ":"

    def parameter(m: re.Match) -> str:
        flag = flags[m.group(1)]
        if flag in message:  # the message words it for both already
            return m.group(0)
        value = _value(m)
        return flag if value in (None, "", "True") else f"{flag} {value}"

    subjects = "|".join(sorted(map(re.escape, {**flags, **SUBJECT_FLAGS}), key=len, reverse=True))
    message = re.sub(r"^(" + subjects + r"):", subject, message)
    # not an argument inside a call: split_array(like=...) stays as it is
    return re.sub(r"(?<![\w.])(?<!\w\()(" + names + r")=" + _VALUE, parameter, message)

def one_line(message: object, command: str | None = None) -> str:
    """An error or warning as ``command`` prints it: one line, parameters as flags."""
    return as_flags(" ".join(str(message).split()), command)


class FlagFormatter(logging.Formatter):
    """Log lines as the command prints them: parameters as flags."""

    def format(self, record: logging.LogRecord) -> str:
        return as_flags(super().format(record))
