"""Pooling: per-channel, so channel-packed tensors pool as they are."""
from __future__ import annotations

from typing import TYPE_CHECKING

from onnxfuse.core.layout import packed
from onnxfuse.core.rules._registry import rule

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup


@rule("MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
def fuse_pool(g: "NodeGroup") -> None:
    """B pools -> one pool with the same attributes.

    Layout: x [N, B*C, *S] -> y [N, B*C, *S'] channel-packed.
    Math: pooling windows never cross channels, so model b's channels pool exactly as alone.
    """
    if len(g.node.output) > 1 and g.node.output[1]:
        g.fail("the Indices output of MaxPool is not supported (it would count the fused channels)")
    g.emit_same([g.get(0, packed(1))], packed(1))
