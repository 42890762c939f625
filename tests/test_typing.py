"""The decorator's types, checked by mypy --strict over tests/typing_checks.py."""

from __future__ import annotations

import pathlib

import pytest

api = pytest.importorskip("mypy.api")

ROOT = pathlib.Path(__file__).parent.parent
CONFIG = str(ROOT / "pyproject.toml")

# mypy reuses its cache: a few seconds warm, about 20 cold.
pytestmark = pytest.mark.timeout(60)


def mypy(path: pathlib.Path) -> tuple[str, int]:
    out, err, status = api.run(["--strict", "--config-file", CONFIG, str(path)])
    return out + err, status


@pytest.mark.slow
def test_the_decorator_keeps_every_signature() -> None:
    report, status = mypy(ROOT / "tests" / "typing_checks.py")
    assert status == 0, report


def test_the_check_catches_a_lost_signature(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # where mypy finds tests.typing_checks
    # A static method given an instance, a class method given its class, as
    # if neither were bound: errors.
    wrong = tmp_path / "wrong.py"
    wrong.write_text(
        "from tests.typing_checks import Kinds\n"
        "Kinds().static.sync(Kinds(), 1)\n"
        "Kinds.made.sync(Kinds, 1)\n"
    )
    report, status = mypy(wrong)
    assert status == 1
    assert "wrong.py:2: error:" in report, report
    assert "wrong.py:3: error:" in report, report
