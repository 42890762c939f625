"""How the command line's text becomes a setting's value: a number, seconds,
origins. A parser only reads; what a value may be is the config's to check
(``config_checks.py``). Main thread, before the server starts."""

from __future__ import annotations

__all__ = ["origins", "seconds", "seconds_or_none", "whole"]


def whole(text: str) -> int:
    """A whole number."""
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"must be a whole number, not {text!r}") from None


def seconds(text: str) -> float:
    """A number of seconds."""
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"must be a number of seconds, not {text!r}") from None


def seconds_or_none(text: str) -> float | None:
    """A number of seconds; 0 means no limit (None)."""
    return seconds(text) or None


def origins(text: str) -> tuple[str, ...]:
    """Comma-separated origins (``https://app.example``), or ``*`` for any."""
    found = tuple(item.strip().rstrip("/") for item in text.split(",") if item.strip())
    if not found:
        raise ValueError("give at least one origin, e.g. https://app.example")
    return found
