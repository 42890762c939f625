"""``python -m mlx_pinned.server serve ...``: the same as ``mlx-pinned serve ...``."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
