"""The settings: declared once, and documented from their declarations."""

from __future__ import annotations

from pathlib import Path

from mlx_pinned.server.cli_options import settings_table, table_in

DOCS = Path(__file__).parents[2] / "docs" / "server.md"


def test_the_docs_table_is_what_the_declarations_give() -> None:
    assert table_in(DOCS.read_text()) == settings_table(), (
        "docs/server.md's table of settings differs from the declarations in "
        "server/config.py: run python -m mlx_pinned.server.cli_options "
        "docs/server.md"
    )
