"""Fresh random ids for answers, items and tool calls: unique, not secret.

Any thread (the event loop, in practice): one generator seeded from the OS
per process (forks re-seeded), not a system call per id, which on the
event loop would also give up the GIL. Each API writes
its own prefix around :func:`random_hex`.
"""

from __future__ import annotations

import os
import random

__all__ = ["random_hex"]

_ids = random.Random(os.urandom(16))
if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=lambda: _ids.seed(os.urandom(16)))


def random_hex(bits: int) -> str:
    """``bits`` random bits as lowercase hex, zero-padded to ``bits // 4``
    digits."""
    return f"{_ids.getrandbits(bits):0{bits // 4}x}"
