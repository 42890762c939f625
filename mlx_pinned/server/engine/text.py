"""Text from tokens: per-token decoding and stop strings. Pure Python."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["StopMatcher", "TextDecoder", "token_bytes"]


class StopMatcher:
    """Cuts generated text at the first stop string.

    Text that could be the start of a stop string is held back until it is
    known not to be one, so a stop string never reaches the client; with
    ``include`` (vLLM's ``include_stop_str_in_output``) the text ends with it.
    """

    def __init__(self, stops: Sequence[str], *, include: bool = False) -> None:
        self.stops = tuple(stops)
        self._include = include
        self._pending = ""
        self.hit: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; returns the text safe to release and whether a stop hit."""
        if not self.stops:
            return text, False
        pending = self._pending + text
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._pending = ""
            first = min(hits)
            self.hit = next(s for s in self.stops if pending.find(s) == first)
            end = first + len(self.hit) if self._include else first
            return pending[:end], True
        hold = 0
        for k in range(min(len(pending), max(map(len, self.stops)) - 1), 0, -1):
            if any(s.startswith(pending[-k:]) for s in self.stops):
                hold = k
                break
        self._pending = pending[len(pending) - hold :]
        return pending[: len(pending) - hold], False

    def flush(self) -> str:
        """The text held back, released at the end of the generation."""
        text, self._pending = self._pending, ""
        return text


class TextDecoder:
    """Text per token: byte-level BPE tokens through an incremental UTF-8
    decoder, so text streams token by token instead of word by word; other
    tokenizers through mlx-vlm's own streaming detokenizer."""

    def __init__(self, processor: Any, token_bytes: Callable[[int], list[int]]) -> None:
        detokenizer = getattr(processor, "detokenizer", None)
        self._token_bytes = token_bytes
        self._bytes = getattr(detokenizer, "_byte_decoder", None) is not None
        self._trim = bool(getattr(detokenizer, "trim_space", False))
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._started = False

    def add(self, token: int, fallback: str) -> str:
        """The text this token completes; ``fallback``: mlx-vlm's text for it."""
        if not self._bytes:
            return fallback
        return self._emit(self._decoder.decode(bytes(self._token_bytes(token))))

    def finish(self, fallback: str) -> str:
        """Whatever is left at the end of the generation."""
        if not self._bytes:
            return fallback
        return self._emit(self._decoder.decode(b"", final=True))

    def _emit(self, text: str) -> str:
        if self._trim and not self._started and text.startswith(" "):
            text = text[1:]
        self._started = self._started or bool(text)
        return text


def token_bytes(processor: Any, tokenizer: Any, token_id: int) -> bytes:
    """The exact bytes of a token: through the byte-level BPE map if there is one."""
    detokenizer = getattr(processor, "detokenizer", None)
    byte_decoder = getattr(detokenizer, "_byte_decoder", None)
    if byte_decoder is not None:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and all(c in byte_decoder for c in piece):
            return bytes(byte_decoder[c] for c in piece)
    return str(tokenizer.decode([token_id])).encode("utf-8")
