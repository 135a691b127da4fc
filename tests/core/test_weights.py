"""Weight mapping: pack -> unpack is the identity, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from onnxfuse.core.layout import SHARED, packed, stacked
from onnxfuse.core.weights import FusedWeight, WeightSlot, pack_weights, relayout, unpack_weight


@pytest.mark.parametrize("B", [1, 2, 5])
@pytest.mark.parametrize("shape,slot", [
    ((6, 3, 5, 5), WeightSlot(None, (6, 3, 5, 5))),          # conv filters, packed along Cout
    ((10, 84), WeightSlot((1, 0), (1, 84, 10))),              # Gemm transB weight -> [B, K, N]
    ((7,), WeightSlot(None, (1, 1, 7))),                      # bias -> [B, 1, N]
    ((4, 1, 1), WeightSlot(None, (4, 1, 1))),                 # [C,1,1] bias next to a channel-packed tensor
    ((2, 3, 4), WeightSlot((2, 0, 1), (1, 1, 4, 2, 3))),      # any transpose + reshape
])
def test_pack_unpack_roundtrip_bit_exact(B, shape, slot, rng):
    arrays = [rng.standard_normal(shape).astype(np.float32) * 10.0 ** rng.integers(-30, 30) for _ in range(B)]
    fused = pack_weights(slot, arrays)
    fw = FusedWeight("w", slot, tuple(shape), "float32", "param", [f"w{b}" for b in range(B)])
    assert list(fused.shape) == fw.fused_shape
    for b in range(B):
        back = unpack_weight(fw, fused, b)
        assert back.shape == arrays[b].shape
        assert back.tobytes() == arrays[b].tobytes()
        # model-major: model b's block is a contiguous slice, so the optimizer's [B, -1] view is per model
        assert np.array_equal(fused.reshape(B, -1)[b], slot.to_block(arrays[b]).reshape(-1))


def test_layout_shapes():
    assert packed(1).fused_shape(["N", 6, 5, 5], 3) == ["N", 18, 5, 5]
    assert stacked(0).fused_shape(["N", 10], 4) == [4, "N", 10]
    assert stacked(2).fused_axis(1) == 1 and stacked(2).fused_axis(2) == 3
    assert SHARED.fused_shape([2, 3], 7) == [2, 3]


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("shape,src,dst", [
    ((5, 4), WeightSlot(None, (5, 4)), WeightSlot((1, 0), (1, 4, 5))),              # embedding table -> Gemm transB
    ((5, 4), WeightSlot((1, 0), (1, 4, 5)), WeightSlot(None, (5, 4))),              # and back
    ((5, 4), WeightSlot(None, (1, 5, 4)), WeightSlot(None, (5, 4))),                # stacked(0) -> packed(0): Reshape
    ((7,), WeightSlot(None, (1, 1, 7)), WeightSlot(None, (1, 1, 1, 7))),            # a bias at two ranks
    ((2, 3, 4), WeightSlot((2, 0, 1), (1, 4, 6)), WeightSlot((1, 2, 0), (3, 4, 2))),  # any two transposes
])
def test_relayout_turns_one_packing_into_the_other_bit_exact(B, shape, src, dst, rng):
    """A tied weight is packed once; its other slot is computed with relayout's Reshape/Transpose steps."""
    arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(B)]
    x = pack_weights(src, arrays)
    for op, arg in relayout(src, dst, shape, B):
        x = np.transpose(x, arg) if op == "Transpose" else np.reshape(x, arg)
    assert x.tobytes() == pack_weights(dst, arrays).tobytes() and x.shape == pack_weights(dst, arrays).shape
    assert relayout(src, src, shape, B) == []
