"""``python -m onnxfuse``: the ``onnxfuse`` command (``onnxfuse/cli/main.py``)."""
import sys

from onnxfuse.cli.main import main

sys.exit(main())
