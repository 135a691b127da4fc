"""The ``onnxfuse`` command (the top layer): ``main.py`` parses the arguments and turns every user error into one
line; ``place.py`` is ``onnxfuse place``; ``demo.py`` is ``onnxfuse demo``."""
from onnxfuse.cli.main import main

__all__ = ["main"]
