"""mlx-vlm as a range: the installed release is inside the package's range.
Run at the newest release by the suite and at the lowest by
.ci/lowest-mlx-vlm.sh, which reads the lowest from the same line."""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _mlx_vlm_requirement() -> Requirement:
    # The checkout's own (an editable install's metadata is its install's).
    [line] = re.findall(r'"(mlx-vlm\b[^"]*)"', PYPROJECT.read_text())
    return Requirement(line)


def test_the_installed_mlx_vlm_is_inside_the_range() -> None:
    requirement = _mlx_vlm_requirement()
    operators = sorted(spec.operator for spec in requirement.specifier)
    assert operators == ["<", ">="]  # a range, never one pinned release
    assert Version(md.version("mlx-vlm")) in requirement.specifier
