"""``python -m pipecut``: the same as the ``pipecut`` command."""

import sys

from pipecut.cli.main import main

sys.exit(main())
