"""``python -m moeify``: the command line, as torchrun starts it (``torchrun ... -m moeify convert ...``)."""

import sys

from moeify.cli.main import main

sys.exit(main())
