import sys

from onnxfuse.cli.main import main

sys.exit(main())
