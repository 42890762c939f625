"""What a served model can take: the one value every API's checks read.

Event loop, pure Python. :meth:`Capabilities.of` reads it from the engine the
model registry holds (:mod:`.residency`) and the model's format settings, in
this one place, once per load (it is kept on the model's slot); each API's
serving module checks a request against it once, before the request waits
for the model's gate. The engine itself checks
only what needs the exact prompt (its length in tokens, on the MLX thread).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..formats import ModelFormats, model_formats

if TYPE_CHECKING:
    from ..events import Engine
    from .served_models import ServedModel

__all__ = ["Capabilities"]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one served model can take, as plain values.

    Attributes:
        context_length: Its context in tokens (None: unknown).
        vocab_size: Valid token ids are below it.
        longest_token_chars: Characters in its longest token, which bounds
            the tokens a text is at least.
        accepts_images: Whether it takes images.
        chat_template: Its chat template (None: it has none); whether it
            thinks is read from it.
        formats: Its tool-call and reasoning formats (None each: it has
            none), set for it or detected from its template.
    """

    context_length: int | None
    vocab_size: int
    longest_token_chars: int
    accepts_images: bool
    chat_template: str | None
    formats: ModelFormats

    @classmethod
    def of(cls, engine: Engine, served: ServedModel) -> Capabilities:
        """The capabilities of ``served``, loaded as ``engine``: read once per
        load (its formats detected from its template), then kept on its slot
        until it is unloaded."""
        slot = served.slot
        if slot.engine is engine and slot.capabilities is not None:
            return slot.capabilities
        template = engine.chat_template
        capabilities = cls(
            context_length=engine.context_length,
            vocab_size=engine.vocab_size,
            longest_token_chars=engine.longest_token_chars,
            accepts_images=engine.accepts_images,
            chat_template=template,
            formats=model_formats(
                template,
                tool_call_parser=served.tool_call_parser,
                reasoning_parser=served.reasoning_parser,
            ),
        )
        if slot.engine is engine:  # kept until the residency unloads it
            slot.capabilities = capabilities
        return capabilities
