"""docs/fastapi.md, run for real: its app.py and test_app.py are written to a
folder and its own tests run there with pytest, in a fresh process.

One more run checks that the recipe's concurrency test has teeth: without
the exclusive key, it fails.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "fastapi.md"
# A file of the recipe: ```python title="app.py"
FILE = re.compile(r'^```python title="([\w.]+)"\n(.*?)^```', re.DOTALL | re.MULTILINE)
DEADLINE = 100.0  # seconds; below pytest's 120 s timeout per test


def recipe() -> dict[str, str]:
    return dict(FILE.findall(PAGE.read_text()))


def run_recipe(folder: pathlib.Path, files: dict[str, str]) -> str:
    """Write ``files`` to ``folder`` and run pytest there; its output."""
    for name, source in files.items():
        (folder / name).write_text(source)
    done = subprocess.run(
        [
            sys.executable,
            *("-m", "pytest", "test_app.py", "-q", "-p", "no:cacheprovider"),
            *("-W", "error", "--timeout", "60"),
        ],
        capture_output=True,
        text=True,
        cwd=folder,
        env={
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "MLX_PINNED_CACHE": str(folder / "cache"),
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
            ),
        },
        timeout=DEADLINE,
        check=False,
    )
    return done.stdout + done.stderr


def test_the_page_shows_the_app_and_its_tests_and_nothing_untested() -> None:
    assert set(recipe()) == {"app.py", "test_app.py"}
    # Every other block on the page is shell, not Python that would go unrun.
    assert not re.search(r"^```python$", PAGE.read_text(), re.MULTILINE)


@pytest.mark.slow
def test_the_recipe_tests_pass(tmp_path: pathlib.Path) -> None:
    output = run_recipe(tmp_path, recipe())
    assert re.search(r"^5 passed", output, re.MULTILINE), output


@pytest.mark.slow
def test_without_the_exclusive_key_the_concurrency_test_fails(
    tmp_path: pathlib.Path,
) -> None:
    files = recipe()
    keyed = 'thread=mlx_thread, exclusive="vlm"'
    assert files["app.py"].count(keyed) == 2
    files["app.py"] = files["app.py"].replace(keyed, "thread=mlx_thread")
    output = run_recipe(tmp_path, files)
    failed = re.findall(r"^FAILED test_app\.py::(\w+)", output, re.MULTILINE)
    assert failed == ["test_concurrent_requests_get_what_they_get_alone"], output


@pytest.mark.parametrize("name", ["app.py", "test_app.py"])
def test_the_recipe_files_are_formatted(name: str, tmp_path: pathlib.Path) -> None:
    ruff = pathlib.Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed beside this Python")
    (tmp_path / name).write_text(recipe()[name])
    done = subprocess.run(
        [str(ruff), "format", "--diff", "--config", str(ROOT / "pyproject.toml"), name],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
