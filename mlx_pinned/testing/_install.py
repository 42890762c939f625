"""Writing a model folder atomically: staged beside its path, renamed in.

Runs on the calling thread; safe from many threads and processes at once. A
folder is complete when its marker (written last) matches what the caller
expects and every file it lists has the listed size.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import tempfile
import uuid
from collections.abc import Callable
from typing import Any, Final

MARKER: Final = "mlx_pinned_tiny_vlm.json"
_INSTALL_ATTEMPTS: Final = 8
# errno values rename(2) reports when the destination is taken.
_TAKEN: Final = frozenset({errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR})

#: The marker a folder should hold, given the sizes of its files.
Expected = Callable[[dict[str, int]], dict[str, Any]]


def to_json(value: object) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode("utf-8")


def write_folder(
    target: pathlib.Path,
    expected: Expected,
    write: Callable[[pathlib.Path], None],
    *,
    overwrite: bool,
) -> pathlib.Path:
    """Write a model folder at ``target`` with ``write``, unless one is there.

    ``write`` fills a staging folder; the marker is added last, and the
    folder renamed into place, so a folder that appears at ``target`` is
    always complete.
    """
    if not overwrite:
        if is_complete(target, expected):
            return target
        check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(
        tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    )
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; a cache is shared
        write(staging)
        sizes = {p.name: p.stat().st_size for p in sorted(staging.iterdir())}
        (staging / MARKER).write_bytes(to_json(expected(sizes)))
        _install(staging, target, expected, overwrite=overwrite)
    finally:
        # Still there only when the install failed.
        shutil.rmtree(staging, ignore_errors=True)
    return target


def is_complete(folder: pathlib.Path, expected: Expected) -> bool:
    """Whether ``folder`` holds a complete model with the expected marker."""
    try:
        marker = json.loads((folder / MARKER).read_bytes())
        return marker == expected(marker["files"]) and all(
            (folder / name).stat().st_size == size
            for name, size in marker["files"].items()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def check_replaceable(target: pathlib.Path) -> None:
    """Raise unless ``target`` is absent, an empty folder or one of our models."""
    if not os.path.lexists(target):
        return
    if target.is_dir() and not target.is_symlink():
        if (target / MARKER).is_file() or not any(target.iterdir()):
            return
    raise FileExistsError(
        f"{target} exists and is not a model written by make_tiny_vlm; "
        "pass overwrite=True to replace it, or choose another path."
    )


def _install(
    staging: pathlib.Path,
    target: pathlib.Path,
    expected: Expected,
    *,
    overwrite: bool,
) -> None:
    """Rename ``staging`` to ``target``, moving aside what is in the way."""
    replace_complete = overwrite
    trash: list[pathlib.Path] = []
    try:
        for _ in range(_INSTALL_ATTEMPTS):
            try:
                # Atomic; replaces an empty folder, fails on anything else.
                staging.rename(target)
                return
            except OSError as exc:
                if exc.errno not in _TAKEN:
                    raise
            # Another call may have installed the same model meanwhile: keep
            # it, unless this call must replace what was there when it began.
            if not replace_complete and is_complete(target, expected):
                return
            replace_complete = False
            if not overwrite:
                check_replaceable(target)
            trash.extend(_move_aside(target))
        raise RuntimeError(
            f"Could not install the tiny model at {target}: other writers kept "
            "replacing it; call make_tiny_vlm again once they are done."
        )
    finally:
        # Deleted only now, so the path is missing for two renames at most.
        for old in trash:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)


def _move_aside(target: pathlib.Path) -> list[pathlib.Path]:
    """Rename ``target`` to a hidden sibling and return it (none if it is gone)."""
    trash = target.with_name(f".{target.name}.{uuid.uuid4().hex}.old")
    try:
        target.rename(trash)
    except FileNotFoundError:  # another writer moved it first
        return []
    return [trash]
