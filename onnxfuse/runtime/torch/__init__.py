"""The torch runtime's ONNX-to-torch layer: ``kernels`` (one builder per ONNX op, one module per op family)."""
