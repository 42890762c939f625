"""The checks every API's serving module runs against the served model's
:class:`~.capabilities.Capabilities` and this server's limits, whatever the
API's shapes.

Event loop; a forced call's grammar is checked in a worker thread
(:mod:`.structured`). Each check takes the parameter names and wording its
API uses, so an API's errors stay its own; none imports a slice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..events import GenerationParams, Grammar
from ..formats import TOOL_CALL_FORMATS, UnforcedCallError
from ..limits import check_text_length
from .errors import APIError
from .structured import check_grammar

if TYPE_CHECKING:
    from ..config import ServerConfig
    from ..formats import ToolCallFormat, ToolSpec
    from ..media import ImageRef, VideoRef
    from .capabilities import Capabilities

__all__ = [
    "check_images",
    "check_logit_bias",
    "check_max_tokens",
    "check_prompt_text",
    "forced_call_grammar",
    "no_tool_call_format",
    "out_of_vocabulary",
    "unforced_call",
]


def check_prompt_text(
    config: ServerConfig, capabilities: Capabilities, chars: int
) -> int | None:
    """The prompt limit in tokens (the server's, else the model's context;
    None: neither is known), with ``chars`` of text checked against it.

    Raises:
        PromptTooLongError: The text alone is over the limit.
    """
    max_prompt = config.max_prompt_tokens or capabilities.context_length
    if max_prompt is not None:
        check_text_length(chars, capabilities.longest_token_chars, max_prompt)
    return max_prompt


def check_max_tokens(
    param: str, asked: int, limit: int, *, code: str | None = "invalid_value"
) -> int:
    """``asked`` (the request's ``param``), within the server's ``limit``.

    Raises:
        APIError: 400 naming ``param``, over the limit.
    """
    if asked > limit:
        raise APIError(
            400,
            f"Invalid value for '{param}': {asked} is more than this server's "
            f"limit of {limit} tokens.",
            param=param,
            code=code,
        )
    return asked


def out_of_vocabulary(param: str, token_id: int, vocab: int) -> APIError:
    """The 400 for a token id of ``param`` the vocabulary does not have."""
    return APIError(
        400,
        f"Invalid value for '{param}': token id {token_id} is outside the "
        f"vocabulary (0 to {vocab - 1}).",
        param=param,
        code="invalid_value",
    )


def check_logit_bias(params: GenerationParams, vocab: int) -> None:
    """Refuse a ``logit_bias`` token id outside the vocabulary.

    Raises:
        APIError: 400 naming ``logit_bias``.
    """
    for token_id, _ in params.sampling.logit_bias:
        if token_id >= vocab:
            raise out_of_vocabulary("logit_bias", token_id, vocab)


def no_tool_call_format(
    tools: str = "tools", *, code: str | None = "unsupported_parameter"
) -> APIError:
    """The 400 for tools sent to a model with no tool-call format (``tools``:
    what the API calls the tools it cannot take)."""
    return APIError(
        400,
        "This model has no tool-call format (none in its chat template, "
        f"or tool_call_parser 'none'): send the request without {tools}, or "
        f"serve it with --tool-call-parser {'|'.join(TOOL_CALL_FORMATS)}.",
        param="tools",
        code=code,
    )


def check_images(
    refs: Sequence[ImageRef] | Sequence[VideoRef],
    capabilities: Capabilities,
    message: str,
    code: str,
) -> None:
    """Refuse images (or videos) for a model that takes none, naming the
    first with ``message`` and ``code``.

    Raises:
        ImageRefusedError: The first image's error.
        VideoRefusedError: The first video's error.
    """
    if refs and not capabilities.accepts_images:
        raise refs[0].error(message, code)


def unforced_call(message: str) -> APIError:
    """OpenAI's 400 for a ``tool_choice`` the model's format cannot force."""
    return APIError(400, message, param="tool_choice", code="unsupported_parameter")


async def forced_call_grammar(
    tool_format: ToolCallFormat,
    specs: list[ToolSpec],
    parallel: bool,
    unforced: Callable[[str], APIError],
) -> Grammar:
    """The grammar of a forced call of ``specs`` (one, or one or more when
    ``parallel``) in ``tool_format``, checked.

    Raises:
        APIError: ``unforced(message)`` when the format cannot force the
            call; a 400 naming ``tools`` when the grammar does not compile.
    """
    try:
        source = tool_format.grammar(specs, parallel)
    except UnforcedCallError as exc:  # its message names the format
        raise unforced(str(exc)) from None
    grammar = Grammar("lark", source)
    await check_grammar(grammar, "tools")
    return grammar
