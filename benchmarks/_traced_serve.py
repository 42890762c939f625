"""``mlx-pinned serve`` with Python's allocations traced, for the soak's
``--trace``: each ``SIGUSR1`` writes where the memory allocated since the
first one is held (file and line, biggest first) to ``$SOAK_TRACE``; the
first only marks the start. A diagnostic, not for CI: tracing slows the
server several times over.

    python benchmarks/_traced_serve.py serve --demo ...
"""

from __future__ import annotations

import os
import signal
import sys
import tracemalloc
from pathlib import Path
from typing import Any

from mlx_pinned.server.cli import main

tracemalloc.start(12)
_start: list[tracemalloc.Snapshot] = []


def _dump(*_: Any) -> None:
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    if not _start:
        _start.append(snapshot)
        return
    stats = snapshot.compare_to(_start[0], "traceback")[:15]
    grown = sum(stat.size_diff for stat in stats) / 2**20
    out = [f"grown since the mark, the top 15: {grown:.1f} MiB"]
    for stat in stats:
        size, count = stat.size_diff / 2**20, stat.count_diff
        out.append(f"\n{size:+.2f} MiB in {count:+d} blocks")
        out += [f"    {line}" for line in stat.traceback.format(limit=8)]
    Path(os.environ["SOAK_TRACE"]).write_text("\n".join(out) + "\n")


signal.signal(signal.SIGUSR1, _dump)
sys.exit(main(sys.argv[1:]))
