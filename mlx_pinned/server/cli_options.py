"""How ``mlx-pinned serve`` spells each setting: one :class:`Option` per
declared field, derived from its declaration; also the docs' table
(``python -m mlx_pinned.server.cli_options docs/server.md``). Runs on the
main thread, before the server starts.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import re
import sys
import textwrap
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .config import ImageLimits, ServerConfig
from .config_checks import (
    SAME,
    Setting,
    origins,
    seconds,
    seconds_or_none,
    whole,
)
from .kinds import KINDS

__all__ = [
    "API_KEY_ENV",
    "NOT_ON_THE_COMMAND_LINE",
    "OPTIONS",
    "Option",
    "add_options",
    "origins",
    "seconds",
    "seconds_or_none",
    "settings_table",
    "table_in",
    "whole",
    "write_settings_table",
]

#: The fields that have no flag, and where the command line takes them from.
NOT_ON_THE_COMMAND_LINE = {
    "model": "the command's MODEL arguments, or a config file's [[models]]",
    "image_limits": "a flag for each limit (image_limits.<name>)",
    "model_settings": "a config file's [[models]] tables",
}

# How a flag's text is read, by the field's type (None: a switch).
_READ: dict[object, Callable[[str], Any] | None] = {
    bool: None,
    int: whole,
    float: seconds,
    (float, None): seconds_or_none,  # 0: no limit
    str: str,
}
# The docs' table, between these lines.
_BEGIN = "<!-- settings: python -m mlx_pinned.server.cli_options docs/server.md -->"
_END = "<!-- /settings -->"


@dataclass(frozen=True)
class Option:
    """One setting on the command line.

    Attributes:
        setting: The field (``image_limits.max_bytes`` for a limit).
        parse: Reads the flag's text; its ValueError is the usage error's
            text. None: a switch (``--x``; also ``--no-x`` where it is on
            by default).
        markdown: Its help, as declared (the string under the field).
    """

    setting: str
    declared: Setting
    field_default: Any
    parse: Callable[[str], Any] | None
    markdown: str

    @property
    def flag(self) -> str:
        name = self.setting.rpartition(".")[2]
        return self.declared.flag or "--" + name.replace("_", "-")

    @property
    def key(self) -> str:
        """Its key in a config file: ``max_num_seqs`` for ``--max-num-seqs``."""
        return self.flag[2:].replace("-", "_")

    def command_line_default(self) -> Any:
        own = self.declared.cli
        return self.field_default if own is SAME else own

    def shown(self) -> str:
        value = self.command_line_default()
        if self.declared.shown is not None:
            return self.declared.shown
        if self.declared.env is not None:
            return f"`${self.declared.env}`"
        if value is None or isinstance(value, bool):
            return "on" if value else "off"
        if self.setting.endswith("_bytes"):  # and a whole number of a unit
            for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
                if value % (1 << shift) == 0:
                    return f"`{value}` ({value >> shift} {unit})"
        return f"`{value}`"

    def help(self) -> str:
        text = f"{self.markdown} (default: {self.shown()}"
        if self.parse is None and self.command_line_default():
            text += f"; --no-{self.flag[2:]} turns it off"
        return _plain(text + ")")


def _options(cls: type = ServerConfig, prefix: str = "") -> Iterator[Option]:
    hints, helps = typing.get_type_hints(cls), _helps(cls)
    for item in dataclasses.fields(cls):
        if item.name == "image_limits":
            yield from _options(ImageLimits, "image_limits.")
        elif "setting" in item.metadata:
            declaration: Setting = item.metadata["setting"]
            parse = declaration.parse or _READ[_kind(hints[item.name])]
            name, markdown = prefix + item.name, helps[item.name]
            yield Option(name, declaration, item.default, parse, markdown)


def _helps(cls: type) -> dict[str, str]:
    """The string under each field of ``cls`` in its source (its attribute
    docstring), on one line."""
    (body,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    assert isinstance(body, ast.ClassDef)
    found = {}
    for node, under in itertools.pairwise(body.body):
        value = under.value if isinstance(under, ast.Expr) else None
        text = value.value if isinstance(value, ast.Constant) else None
        if isinstance(node, ast.AnnAssign) and isinstance(text, str):
            assert isinstance(node.target, ast.Name)
            found[node.target.id] = " ".join(text.split())
    return found


def _kind(hint: Any) -> object:
    if typing.get_origin(hint) is Literal:
        return str
    kinds = tuple(arg for arg in typing.get_args(hint) if arg is not type(None))
    if kinds == (float,):
        return (float, None)
    return kinds[0] if len(kinds) == 1 else hint


OPTIONS = tuple(_options())

API_KEY_ENV: str = next(o.declared.env for o in OPTIONS if o.declared.env)


def add_options(parser: argparse.ArgumentParser) -> None:
    """A flag for each of :data:`OPTIONS` that sets nothing when not given:
    the namespace holds the flags given, and only those."""
    for option in OPTIONS:
        common: dict[str, Any] = {
            "dest": option.setting,
            "default": argparse.SUPPRESS,
            "help": option.help().replace("%", "%%"),
        }
        if option.parse is None:  # a switch
            on = option.command_line_default()
            action = argparse.BooleanOptionalAction if on else "store_true"
            parser.add_argument(option.flag, action=action, **common)
        else:
            parser.add_argument(
                option.flag,
                type=_argument(option.parse),
                action="append" if option.declared.repeated else "store",
                metavar=option.key.upper(),
                **common,
            )


def settings_table() -> str:
    rows = ["| flag | default | per model | meaning |", "|---|---|---|---|"]
    for option in OPTIONS:
        flag = f"`{option.flag}`"
        if option.parse is None and option.command_line_default():
            flag += f", `--no-{option.flag[2:]}`"
        own = _kinds(option.setting) if option.declared.per_model else ""
        rows.append(f"| {flag} | {option.shown()} | {own} | {option.markdown} |")
    return "\n".join(rows)


def _kinds(setting: str) -> str:
    kinds = [kind.name for kind in KINDS.values() if kind.honours(setting)]
    return "every kind" if len(kinds) == len(KINDS) else ", ".join(kinds)


def write_settings_table(path: str | Path) -> None:
    """Put :func:`settings_table` between the markers of the file at ``path``."""
    text = Path(path).read_text()
    start, end = text.index(_BEGIN) + len(_BEGIN), text.index(_END)
    Path(path).write_text(f"{text[:start]}\n{settings_table()}\n{text[end:]}")


def table_in(text: str) -> str:
    return text[text.index(_BEGIN) + len(_BEGIN) : text.index(_END)].strip()


def _plain(markdown: str) -> str:
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", markdown).replace("`", "")


def _argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` for argparse: its ValueError becomes the usage error's text."""

    def read(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    read.__name__ = parse.__name__  # argparse names it in some messages
    return read


if __name__ == "__main__":  # pragma: no cover
    for page in sys.argv[1:]:
        write_settings_table(page)
