"""AffineGrid, which onnxruntime-training 1.19 has no gradient builder for: a product of its base grid and theta."""
from __future__ import annotations

import numpy as np
import onnx

from onnxfuse.core.rewrite import Context, Emitter
from onnxfuse.runtime.ort.legalize._registry import rewrite

__all__ = ["affine_grid"]


def _coords(n: int, align_corners: bool) -> np.ndarray:
    """The normalized coordinates of n pixels along one axis: their centres in (-1, 1), or the corners' -1 and 1
    (align_corners), as torch's affine_grid and the ONNX specification place them."""
    if align_corners:
        return np.linspace(-1.0, 1.0, n) if n > 1 else np.zeros(1)
    return (2 * np.arange(n) + 1) / n - 1


@rewrite("AffineGrid")
def affine_grid(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """AffineGrid(theta [N, k, k+1], size [N, C, *S])  ==>  Reshape(MatMul(base, Transpose(theta)), [N, *S, k]),
    base [prod(S), k+1] the pixels' normalized coordinates (x first) and a 1.

    Layout: the grid's spatial shape S comes from the output's inferred shape (static; the batch may be dynamic).
    Math: grid[n, p] = theta[n] @ (x_p, y_p, (z_p,) 1): the definition; its gradient to theta is base^T @ dgrid, as
    torch's affine_grid backward computes it.
    """
    theta, out = node.input[0], node.output[0]
    shape = ctx.shape(out)
    if shape is None or len(shape) not in (4, 5) or any(not isinstance(d, int) for d in shape[1:]):
        raise ctx.error(node, f"its grid's shape {shape} is not static past the batch",
                        "export the model with a fixed image size (only the batch may be dynamic)")
    spatial, k = shape[1:-1], shape[-1]
    align = bool(ctx.attrs(node).get("align_corners", 0))
    axes = [_coords(n, align) for n in spatial]  # (D,) H, W: the grid's last coordinate is x, along W
    mesh = np.meshgrid(*axes, indexing="ij")
    base = np.stack([m.reshape(-1) for m in reversed(mesh)] + [np.ones(mesh[0].size)], 1)  # [P, k + 1]
    em = Emitter(node, ctx)
    product = em.op("MatMul", [em.like(base, theta, "base_grid"), em.transpose(theta, [0, 2, 1])])
    em.reshape(product, [-1, *spatial, k], output=out)
    return em.nodes
