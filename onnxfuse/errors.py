"""One exception type per kind of bad input; every message names the thing and says how to fix it."""
from __future__ import annotations

__all__ = [
    "OnnxFuseError",
    "InputFileError",
    "NotFusibleError",
    "UnsupportedOpError",
    "UntrainableOpError",
    "ConfigError",
    "DataError",
    "PlacementError",
    "TrainingStoppedError",
    "VerificationError",
]


class OnnxFuseError(Exception):
    """Base class of every error onnxfuse reports to a user (the CLI prints these as one line)."""


class InputFileError(OnnxFuseError):
    """A file or folder given to onnxfuse is missing, unreadable or not what it should be."""


class NotFusibleError(OnnxFuseError):
    """The B models are not the same graph up to weights, or a node cannot be fused as it is."""


class UnsupportedOpError(NotFusibleError):
    """A node's op type has no fusion rule."""

    def __init__(self, node_name: str, op_type: str, model: str, supported: list[str]):
        self.node_name, self.op_type, self.supported = node_name, op_type, supported
        super().__init__(
            f"{model}: node '{node_name}' has op type '{op_type}', which has no fusion rule; "
            f"supported op types: {', '.join(sorted(supported))}. "
            f"To fix this, replace the layer that exports to '{op_type}' or add a rule in onnxfuse/rules/."
        )


class UntrainableOpError(NotFusibleError):
    """A node onnxruntime-training cannot differentiate (or run backward on CPU) and that no legalization rewrite
    can turn into a trainable form."""


class ConfigError(OnnxFuseError):
    """A training or command-line setting is invalid (wrong length, negative, unknown name...)."""


class TrainingStoppedError(OnnxFuseError):
    """A training run stopped early on purpose (e.g. ``--on-diverge stop``); its state up to then is saved."""


class DataError(OnnxFuseError):
    """A data file does not match the graph's inputs."""


class PlacementError(OnnxFuseError):
    """A graph cannot be placed on the given devices (it does not fit their memory, a placement names a missing
    device, a placer does not apply to this graph...)."""


class VerificationError(OnnxFuseError):
    """The fused array's training of some model differs from that model trained alone on the same runtime (the
    run-time check of ``onnxfuse train --verify-steps`` and ``onnxfuse check``): the array would train it wrongly.
    Nothing is written; the CLI exits with status 4."""
