"""Why a request is refused, as values: no HTTP status, no wire path. Raised
on any thread; each API's edge turns them into its error shape in one table.
A :class:`RequestError` is the client's to fix, an :class:`UnavailableError`
the server's state (send it again later).
"""

from __future__ import annotations

__all__ = [
    "AudioRefusedError",
    "ImageRefusedError",
    "ImagesUnsupportedError",
    "InvalidGrammarError",
    "MediaRefusedError",
    "MemoryBusyError",
    "MemoryTooLargeError",
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
    """A request the server will not run as sent: ``message`` says what is
    wrong and what to send instead, ``field`` names the field at fault by
    its shared name (None: not one field)."""

    def __init__(self, message: str, code: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.field = field


class PromptError(RequestError):
    """The prompt (or an input) as sent cannot be run; each door names it in
    its own words (``messages``, ``prompt``, ``input``)."""


class PromptTooLongError(PromptError):
    """A prompt over ``limit``; ``prompt_tokens`` is a lower bound when
    estimated."""

    def __init__(self, message: str, prompt_tokens: int, limit: int) -> None:
        super().__init__(message, "context_length_exceeded")
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class MediaRefusedError(RequestError):
    """A media part the server cannot use; ``index`` counts the parts of its
    kind, in prompt order, from 0 (the edge names the part that holds it)."""

    def __init__(self, message: str, *, index: int, code: str) -> None:
        super().__init__(message, code)
        self.index = index


class ImageRefusedError(MediaRefusedError):
    """An image the server cannot use."""


class VideoRefusedError(MediaRefusedError):
    """A video the server cannot use, or one sent to a model that takes none."""


class AudioRefusedError(MediaRefusedError):
    """An audio file the server cannot use."""


class ImagesUnsupportedError(PromptError):
    """Images sent to a model that takes none."""

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
    after ``retry_after`` seconds (None: waiting will not help, the server's
    settings must change)."""

    def __init__(self, message: str, code: str, *, retry_after: int | None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.retry_after = retry_after


class OverloadedError(UnavailableError):
    """The model's waiting room is full (``waiting`` requests)."""

    def __init__(self, waiting: int, *, retry_after: int) -> None:
        super().__init__(
            f"The server is busy: {waiting} requests are already waiting for the "
            "model; retry shortly.",
            "server_busy",
            retry_after=retry_after,
        )
        self.waiting = waiting


class MemoryBusyError(OverloadedError):
    """A request's images do not fit the memory budget (``max_kv_bytes``)
    now: the requests in flight hold the rest."""

    def __init__(self, budget: int, *, retry_after: int) -> None:
        UnavailableError.__init__(
            self,
            "The server is busy: the requests it runs hold its memory budget "
            f"of {budget} bytes (--max-kv-bytes); retry shortly.",
            "server_busy",
            retry_after=retry_after,
        )
        self.waiting = 0


class MemoryTooLargeError(PromptError):
    """A request that alone needs ``need`` bytes, more than the memory
    budget (``max_kv_bytes``) ever holds: as a prompt past the context,
    the client's to shorten."""

    def __init__(self, need: int, budget: int) -> None:
        super().__init__(
            f"The request needs {need} bytes of memory (its KV for the prompt "
            f"and max_tokens, and its images), more than this server's budget "
            f"of {budget} bytes (--max-kv-bytes): shorten the prompt, lower "
            "max_tokens or send fewer images.",
            "context_length_exceeded",
        )
        self.need = need
        self.budget = budget


class ModelNotLoadedError(UnavailableError):
    """The model is not loaded (yet): its load is under way, or no lifespan
    runs to load it."""

    def __init__(self, name: str, *, retry_after: int) -> None:
        super().__init__(
            f"The model {name!r} is not loaded yet; retry shortly.",
            "model_not_loaded",
            retry_after=retry_after,
        )
        self.name = name


class ModelLoadFailedError(UnavailableError):
    """The model's load failed (the server's log has why); the next request
    for it tries again."""

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
    ever (those loaded at start-up or pinned hold ``kept``: no
    ``Retry-After``)."""

    def __init__(
        self, name: str, need: int, budget: int, kept: int, *, retry_after: int
    ) -> None:
        never = kept + need > budget
        why = (
            f"never fits in this server's max_model_bytes of {budget}: the models "
            f"loaded at start-up or pinned hold {kept}."
            if never
            else f"does not fit in this server's max_model_bytes of {budget} while "
            "the other models are in use; retry shortly."
        )
        super().__init__(
            f"The model {name!r} needs {need} bytes of weights and {why}",
            "model_memory_budget",
            retry_after=None if never else retry_after,
        )
