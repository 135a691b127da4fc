"""Random ops: each model draws its own numbers from its own generator, as when it trains alone.

A fused random op cannot be one node: one generator's draws for [B*N, ...] would give model b numbers that depend
on B and on its place in the array. So every model keeps its own node (``NodeGroup.per_model``, standard ONNX)
with its own ``seed``: the model's seed (its node's seed, 0 without one) and its index in the array, hashed
(``model_seed``; a re-fused array, such as a halving sweep's survivors, keeps each model's index).
Runtimes mix that seed with the run's (``runtime/torch/kernels/_base.py``'s ``RandomStreams``), so two runs
draw differently when asked to and a resumed run continues each stream where it stopped. A random op whose inputs
are all shared still runs per model (``shared_passthrough`` off): the same inputs, different draws."""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from onnxfuse.core.rules._registry import rule

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup

RANDOM = ("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial")


def model_seed(seed: float | None, b: int) -> float:
    """Model b's seed for a node whose own seed is ``seed``: a hash of both, an integer below 2**24 (exact as the
    float ONNX's ``seed`` attribute is)."""
    digest = hashlib.blake2b(f"{float(seed or 0.0)!r}:{b}".encode(), digest_size=4).digest()
    return float(int.from_bytes(digest, "little") % (1 << 24))


@rule(*RANDOM, shared_passthrough=False)
def fuse_random(g: "NodeGroup") -> None:
    """One node per model on model b's input (stacked(0) out), seed ``model_seed(seed, index of model b)``: each
    model's draws are its own, whatever B and its place."""
    seed = g.attr("seed")
    g.per_model(attrs=lambda b: {"seed": model_seed(seed, g.model_ids[b])})
