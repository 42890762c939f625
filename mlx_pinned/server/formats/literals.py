"""Forced arguments in formats that write values in their own literal
syntax, not JSON (pythonic's Python literals, Gemma 4's objects): an
argument's JSON schema as Lark rules of that syntax. Any thread, pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .base import UnforcedCallError
from .blocks import literal, property_items

__all__ = ["LiteralSyntax", "value_rules"]


@dataclass(frozen=True, slots=True)
class LiteralSyntax:
    """How a format writes values.

    Attributes:
        unquoted: A character class (without its brackets) of what a string
            may hold.
        key_format: An object's key and what follows it, ``{key}`` the key.
        any_key: A Lark expression for any key and what follows it.
    """

    format: str
    quote: str
    unquoted: str
    true: str
    false: str
    null: str
    separator: str
    key_format: str
    any_key: str

    def key(self, key: str) -> str:
        return literal(self.key_format.format(key=key))

    def string(self, text: str) -> str:
        if self.quote == '"':  # JSON's escapes are Python's too
            return literal(json.dumps(text, ensure_ascii=False))
        return literal(self.quote + text + self.quote)

    def strings(self, low: int, high: int | None) -> str:
        count = f"{{{low},{'' if high is None else high}}}"
        q = literal(self.quote)
        return f"{q} /[{self.unquoted}]{count}/ {q}"


class _Rules:
    """The rules of one argument's value, named from ``prefix``."""

    def __init__(self, syntax: LiteralSyntax, tool: str, key: str, prefix: str):
        self.syntax, self.tool, self.key, self.prefix = syntax, tool, key, prefix
        self.rules: list[str] = []
        self._any: str | None = None

    def refuse(self, why: str) -> UnforcedCallError:
        return UnforcedCallError(
            f"The {self.syntax.format} tool-call format cannot force "
            f"{self.tool}'s argument {self.key!r}: {why}; use tool_choice 'auto'."
        )

    def rule(self, body: str) -> str:
        name = f"{self.prefix}_{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def list_of(self, item: str, low: int, high: int | None) -> str:
        sep = literal(self.syntax.separator)
        if high is None:
            count = "*" if low <= 1 else "+" if low == 2 else f"{{{low - 1},}}"
        else:
            count = f"{{{max(low - 1, 0)},{max(high - 1, 0)}}}"
        inner = f"{item} ({sep} {item}){count}" if high != 0 else ""
        if low == 0 and inner:
            inner = f"({inner})?"
        return f'"[" {inner} "]"'

    def any_value(self) -> str:
        if self._any is None:
            syntax = self.syntax
            self._any = name = f"{self.prefix}_any"
            sep = literal(syntax.separator)
            entry = f"{syntax.any_key} {name}"
            self.rules.append(
                f'{name}: {syntax.strings(0, None)} | %json {{"type": "number"}}'
                f" | {literal(syntax.true)} | {literal(syntax.false)}"
                f" | {literal(syntax.null)}"
                f' | "[" ({name} ({sep} {name})*)? "]"'
                f' | "{{" ({entry} ({sep} {entry})*)? "}}"'
            )
        return self._any

    def value(self, schema: dict[str, Any]) -> str:
        syntax = self.syntax
        if "$ref" in schema:
            raise self.refuse("it names a '$ref'")
        if "enum" in schema or "const" in schema:
            values = schema.get("enum", [schema.get("const")])
            return " | ".join(self.scalar(value) for value in values)
        for alternatives in ("anyOf", "oneOf"):
            if alternatives in schema:
                options = [self.value(s) for s in schema[alternatives]]
                return self.rule(" | ".join(options))
        kind = schema.get("type")
        if isinstance(kind, list):
            return self.rule(
                " | ".join(self.value({**schema, "type": k}) for k in kind)
            )
        if kind == "string":
            if {"pattern", "format"} & set(schema):
                raise self.refuse(
                    "its strings are written raw, so a 'pattern' or 'format' "
                    "cannot be kept"
                )
            return syntax.strings(schema.get("minLength", 0), schema.get("maxLength"))
        if kind in ("integer", "number"):
            return f"%json {json.dumps(schema)}"
        if kind == "boolean":
            return f"{literal(syntax.true)} | {literal(syntax.false)}"
        if kind == "null":
            return literal(syntax.null)
        if kind == "array":
            items = schema.get("items")
            item = self.value(items) if isinstance(items, dict) else self.any_value()
            low, high = schema.get("minItems", 0), schema.get("maxItems")
            return self.rule(self.list_of(f"({item})", low, high))
        if kind == "object":
            return self.rule(self.object(schema))
        if kind is None:
            return self.any_value()
        raise self.refuse(f"type {kind!r} is not one it can write")

    def object(self, schema: dict[str, Any]) -> str:
        entries = [
            f"{self.syntax.key(key)} ({self.value(value)})"
            for key, value, required in property_items(schema)
            if required
        ]
        if not entries and not schema.get("properties"):
            return self.any_value()
        sep = f" {literal(self.syntax.separator)} "
        return '"{" ' + sep.join(entries) + ' "}"'

    def scalar(self, value: Any) -> str:
        syntax = self.syntax
        if isinstance(value, bool):
            return literal(syntax.true if value else syntax.false)
        if value is None:
            return literal(syntax.null)
        if isinstance(value, str):
            return syntax.string(value)
        if isinstance(value, int | float):
            return literal(json.dumps(value))
        raise self.refuse("an enum of objects or lists")


def value_rules(
    syntax: LiteralSyntax, tool: str, key: str, schema: dict[str, Any], name: str
) -> list[str]:
    """The Lark rules of a value of ``schema`` in ``syntax``: the first is
    ``name``'s, the others are named after it.

    Raises:
        UnforcedCallError: The syntax cannot hold the schema (a string
            ``pattern`` or ``format``, a ``$ref``).
    """
    rules = _Rules(syntax, tool, key, name)
    body = rules.value(schema)
    return [f"{name}: {body}", *rules.rules]
