"""The chat kind: generation, through the continuous batch of :mod:`..engine`
and the doors of :mod:`..http` (chat completions, completions, the Messages
and Responses APIs, tokenize). Any thread."""

from __future__ import annotations

from ..events import Engine
from . import Kind

KIND = Kind(
    name="chat",
    what="a chat model",
    paths=("/v1/chat/completions",),
    protocol=Engine,
)
