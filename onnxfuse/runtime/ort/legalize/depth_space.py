"""DepthToSpace (nn.PixelShuffle) and SpaceToDepth (nn.PixelUnshuffle) have no gradient builder in ORT 1.19:
rewrite them as the Reshape -> Transpose -> Reshape they are."""
from __future__ import annotations

import onnx

from onnxfuse.core.rewrite import COPY, Context, Dims, Emitter
from onnxfuse.runtime.ort.legalize._registry import rewrite

__all__ = ["depth_to_space", "space_to_depth"]


@rewrite("DepthToSpace")
def depth_to_space(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """DepthToSpace(X; blocksize b, mode)  ==>  Reshape -> Transpose -> Reshape.

    Layout: X [N, C, H, W] -> Y [N, C/b^2, H b, W b].
        DCR: Reshape [N, b, b, C/b^2, H, W] -> Transpose (0, 3, 4, 1, 5, 2)
        CRD: Reshape [N, C/b^2, b, b, H, W] -> Transpose (0, 1, 4, 2, 5, 3)   (torch's pixel_shuffle)
        both -> [N, C/b^2, H, b, W, b] -> Reshape [N, C/b^2, H b, W b].
    Math: the ONNX definition; a permutation of elements, whose gradient is the inverse permutation.
    """
    x, y = node.input[0], node.output[0]
    attrs = ctx.attrs(node)
    b, mode = int(attrs["blocksize"]), attrs.get("mode", "DCR")
    C = ctx.static_dim(node, x, 1, "DepthToSpace's channel split")
    shape = ctx.shape(x)
    H, W = Dims(x, (2,), (shape[2],)), Dims(x, (3,), (shape[3],))
    em = Emitter(node, ctx)
    if mode == "CRD":
        t = em.transpose(em.reshape(x, [COPY, C // (b * b), b, b, H, W]), [0, 1, 4, 2, 5, 3])
    else:
        t = em.transpose(em.reshape(x, [COPY, b, b, C // (b * b), H, W]), [0, 3, 4, 1, 5, 2])
    em.reshape(t, [COPY, C // (b * b), Dims(t, (2, 3), (shape[2], b)), Dims(t, (4, 5), (shape[3], b))], output=y)
    return em.nodes


@rewrite("SpaceToDepth")
def space_to_depth(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """SpaceToDepth(X; blocksize b)  ==>  Reshape [N, C, H/b, b, W/b, b] -> Transpose (0, 3, 5, 1, 2, 4)
    -> Reshape [N, C b^2, H/b, W/b].

    Layout: X [N, C, H, W] with H, W static (the split needs H/b); Y [N, C b^2, H/b, W/b].
    Math: the ONNX definition (the inverse of DepthToSpace DCR); a permutation of elements.
    """
    x, y = node.input[0], node.output[0]
    b = int(ctx.attrs(node)["blocksize"])
    C = ctx.static_dim(node, x, 1, "SpaceToDepth's channel count")
    H = ctx.static_dim(node, x, 2, "SpaceToDepth's block split")
    W = ctx.static_dim(node, x, 3, "SpaceToDepth's block split")
    em = Emitter(node, ctx)
    t = em.transpose(em.reshape(x, [COPY, COPY, H // b, b, W // b, b]), [0, 3, 5, 1, 2, 4])
    em.reshape(t, [COPY, C * b * b, H // b, W // b], output=y)
    return em.nodes
