"""``python -m durable.testing``: the receiver, in a process of its own."""

import sys

from . import main

sys.exit(main())
