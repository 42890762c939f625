"""Why a request is refused, as values: no HTTP status, no wire path.

A shared module (no Starlette, no pydantic, no MLX), raised on any thread:
the engine and the limits on the MLX thread, the image decoders on worker
threads, the gate on the event loop. Each API's edge turns these into its own
error shape in one table (for the OpenAI-shaped routes,
:func:`mlx_pinned.server.http.errors.api_error`), so the same condition has
the same answer on every route of an API and a new API brings its own table.

Two kinds: a :class:`RequestError` is the client's to fix (send it again
changed); an :class:`UnavailableError` is the server's state (send it again
later).
"""

from __future__ import annotations

__all__ = [
    "AudioRefusedError",
    "ImageRefusedError",
    "ImagesUnsupportedError",
    "InvalidGrammarError",
    "MediaRefusedError",
    "ModelLoadFailedError",
    "ModelMemoryBudgetError",
    "ModelNotLoadedError",
    "OverloadedError",
    "PromptError",
    "PromptTooLongError",
    "RequestError",
    "UnavailableError",
    "VideoRefusedError",
]


class RequestError(Exception):
    """A request the server will not run as sent.

    Args:
        message: One sentence: what is wrong and what to send instead.
        code: A short machine-readable reason, e.g. ``invalid_grammar``.
        field: The request's field at fault, by its shared name
            (``prediction``); None: not one field.
    """

    def __init__(self, message: str, code: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.field = field


class PromptError(RequestError):
    """The prompt (or an input) as sent cannot be run; each door names it in
    its own words (``messages``, ``prompt``, ``input``)."""


class PromptTooLongError(PromptError):
    """A prompt over a limit; the message gives the numbers.

    Args:
        message: The sentence for the client.
        prompt_tokens: Tokens in the prompt (a lower bound when estimated).
        limit: The limit it broke.
    """

    def __init__(self, message: str, prompt_tokens: int, limit: int) -> None:
        super().__init__(message, "context_length_exceeded")
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class MediaRefusedError(RequestError):
    """An image or a video the server cannot use, named by its index.

    Args:
        message: What is wrong with it and what to send instead.
        index: Which image (or video) of the request, in prompt order, from
            0; the edge names the part of its own request that holds it.
        code: A short machine-readable reason, e.g. ``image_too_large``.
    """

    def __init__(self, message: str, *, index: int, code: str) -> None:
        super().__init__(message, code)
        self.index = index


class ImageRefusedError(MediaRefusedError):
    """An image the server cannot use; ``index`` counts images only."""


class VideoRefusedError(MediaRefusedError):
    """A video the server cannot use: over a limit, undecodable, or sent to a
    model that takes none; ``index`` counts videos only."""


class AudioRefusedError(MediaRefusedError):
    """An audio file the server cannot use: over a limit, or undecodable;
    ``index`` counts audio files only."""


class ImagesUnsupportedError(PromptError):
    """Images sent to a model that takes none (a text-only model)."""

    def __init__(self) -> None:
        super().__init__(
            "This model takes no images; send text parts only.", "images_unsupported"
        )


class InvalidGrammarError(RequestError):
    """A grammar (a JSON schema, a regex, a Lark grammar) that cannot be used."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "invalid_grammar")


class UnavailableError(Exception):
    """The server cannot take the request now; the same request may succeed
    later.

    Args:
        message: One sentence: what is happening and when to come back.
        code: A short machine-readable reason, e.g. ``server_busy``.
        retry_after: Seconds to wait before sending it again; None when
            waiting will not help (the server's settings must change).
    """

    def __init__(self, message: str, code: str, *, retry_after: int | None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.retry_after = retry_after


class OverloadedError(UnavailableError):
    """The model's waiting room is full.

    Args:
        waiting: Requests already waiting for the model.
        retry_after: Seconds to wait before sending it again.
    """

    def __init__(self, waiting: int, *, retry_after: int) -> None:
        super().__init__(
            f"The server is busy: {waiting} requests are already waiting for the "
            "model; retry shortly.",
            "server_busy",
            retry_after=retry_after,
        )
        self.waiting = waiting


class ModelNotLoadedError(UnavailableError):
    """The model is not loaded (yet): its load is under way, or no lifespan
    runs to load it.

    Args:
        name: The served name of the model.
        retry_after: Seconds to wait before sending it again.
    """

    def __init__(self, name: str, *, retry_after: int) -> None:
        super().__init__(
            f"The model {name!r} is not loaded yet; retry shortly.",
            "model_not_loaded",
            retry_after=retry_after,
        )
        self.name = name


class ModelLoadFailedError(UnavailableError):
    """The model's load failed (the server's log has why); the next request
    for it tries again. Its arguments are :class:`ModelNotLoadedError`'s."""

    def __init__(self, name: str, *, retry_after: int) -> None:
        super().__init__(
            f"The model {name!r} could not be loaded (the server's log has the "
            "reason); a later request tries again.",
            "model_load_failed",
            retry_after=retry_after,
        )


class ModelMemoryBudgetError(UnavailableError):
    """The model's ``need`` bytes of weights do not fit in the ``budget``
    (``max_model_bytes``): for now (the models in use hold the rest), or
    ever (those loaded at start-up hold ``pinned``: no ``Retry-After``)."""

    def __init__(
        self, name: str, need: int, budget: int, pinned: int, *, retry_after: int
    ) -> None:
        never = pinned + need > budget
        why = (
            f"never fits in this server's max_model_bytes of {budget}: the models "
            f"loaded at start-up hold {pinned}."
            if never
            else f"does not fit in this server's max_model_bytes of {budget} while "
            "the other models are in use; retry shortly."
        )
        super().__init__(
            f"The model {name!r} needs {need} bytes of weights and {why}",
            "model_memory_budget",
            retry_after=None if never else retry_after,
        )
