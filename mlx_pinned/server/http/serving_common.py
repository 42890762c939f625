"""What every chat API's serving module shares: the checks against the
model's :class:`~..events.ChatFacts` and this server's limits, the answer's
grammar, and what it hands its door (:class:`Prepared`).

Event loop; a grammar is compiled in a worker thread, once for the HTTP
check and the engine. Each check takes the parameter names its API uses.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio

from ..events import GenerationParams, Grammar
from ..formats import TOOL_CALL_FORMATS, UnforcedCallError, json_arguments
from ..grammars import GRAMMARS, GrammarCompileError
from ..limits import check_text_length
from .errors import APIError

if TYPE_CHECKING:
    from PIL import Image

    from ..config import ServerConfig
    from ..events import ChatFacts
    from ..formats import ToolCallFormat, ToolSpec
    from ..media import AudioRef, ImageRef, VideoRef

__all__ = [
    "ForcedCall",
    "GenerationRequest",
    "Prepared",
    "RequestT",
    "Serving",
    "check_grammar",
    "check_media",
    "check_prompt_text",
    "check_scored_stream",
    "check_token_fields",
    "max_tokens",
    "no_tool_call_format",
    "out_of_vocabulary",
    "request_grammar",
    "unforced_call",
    "with_budget",
]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request checked against its model, as its door takes it: media
    references in prompt order, decoded by the door's ``media`` step into
    ``params`` (videos, audio) and ``decoded`` (images); ``tools`` and
    ``template_kwargs`` are what the answer's parser reads."""

    params: GenerationParams
    images: Sequence[ImageRef]
    videos: Sequence[VideoRef] = ()
    tools: Sequence[ToolSpec] = ()
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    audios: Sequence[AudioRef] = ()
    decoded: Sequence[Image.Image] = ()

    @property
    def priority(self) -> int:
        return self.params.priority


class GenerationRequest(Protocol):
    model: str
    stream: bool | None


RequestT = TypeVar("RequestT", bound=GenerationRequest)
RequestT_contra = TypeVar(
    "RequestT_contra", bound=GenerationRequest, contravariant=True
)


class Serving(Protocol[RequestT_contra]):
    """A chat API's one check against the model (its ``serving`` module)."""

    async def prepare(self, request: RequestT_contra, facts: ChatFacts) -> Prepared: ...


def check_prompt_text(config: ServerConfig, facts: ChatFacts, chars: int) -> int | None:
    """The prompt limit in tokens (the server's, else the model's context;
    None: neither is known); a ``PromptTooLongError`` where ``chars`` of
    text alone are over it."""
    max_prompt = config.max_prompt_tokens or facts.context_length
    if max_prompt is not None:
        check_text_length(chars, facts.longest_token_chars, max_prompt)
    return max_prompt


def max_tokens(
    config: ServerConfig,
    param: str,
    asked: int | None,
    *,
    default: int | None = None,
    code: str | None = "invalid_value",
) -> int:
    """The tokens to generate: ``asked`` (the request's ``param``), a 400
    over the server's ``max_tokens_limit`` where one is set; when it asks
    none, ``default`` (else the server's ``default_max_tokens``). The engine
    cuts it to what the model's context leaves after the prompt."""
    if asked is None:
        return config.default_max_tokens if default is None else default
    limit = config.max_tokens_limit
    if limit is not None and asked > limit:
        raise APIError(
            400,
            f"Invalid value for '{param}': {asked} is more than this server's "
            f"limit of {limit} tokens.",
            param=param,
            code=code,
        )
    return asked


def out_of_vocabulary(param: str, token_id: int, vocab: int) -> APIError:
    return APIError(
        400,
        f"Invalid value for '{param}': token id {token_id} is outside the "
        f"vocabulary (0 to {vocab - 1}).",
        param=param,
        code="invalid_value",
    )


def check_token_fields(params: GenerationParams, vocab: int) -> None:
    """Refuse a token id outside the vocabulary and a ``min_tokens`` over
    ``max_tokens``, as vLLM refuses them."""
    sampling = params.sampling
    fields = {
        "logit_bias": [token for token, _ in sampling.logit_bias],
        "stop_token_ids": sampling.stop_token_ids,
        "allowed_token_ids": sampling.allowed_token_ids,
    }
    for param, token_ids in fields.items():
        for token_id in token_ids:
            if token_id >= vocab:
                raise out_of_vocabulary(param, token_id, vocab)
    if sampling.min_tokens > params.max_tokens:
        raise APIError(
            400,
            f"Invalid value for 'min_tokens': {sampling.min_tokens} is more than "
            f"the {params.max_tokens} tokens this request may generate.",
            param="min_tokens",
            code="invalid_value",
        )


def check_scored_stream(params: GenerationParams, stream: bool | None) -> None:
    """Refuse a stream of an answer with its prompt's log-probabilities:
    they come with the answer's end, which a stream has sent by then."""
    if stream and params.sampling.prompt_logprobs is not None:
        raise APIError(
            400,
            "Unsupported value: 'stream' does not support True with the prompt's "
            "log-probabilities ('prompt_logprobs', or 'echo' with 'logprobs'); "
            "send the request unstreamed.",
            param="stream",
            code="unsupported_value",
        )


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


def check_media(
    facts: ChatFacts,
    images: Sequence[ImageRef],
    videos: Sequence[VideoRef] = (),
    audios: Sequence[AudioRef] = (),
) -> None:
    """Refuse images (or videos, or audio) for a model that takes none, with
    the first one's ``MediaRefusedError``."""
    if audios and facts.audio_input is None:
        send = "text or images" if facts.accepts_images else "text only"
        message = f"this model takes no audio; send {send}."
        raise audios[0].error(message, "audio_unsupported")
    if facts.accepts_images:
        return
    for kind, refs in (("images", images), ("videos", videos)):
        if refs:
            message = f"this model takes no {kind}; send text only."
            raise refs[0].error(message, f"{kind}_unsupported")


def unforced_call(message: str) -> APIError:
    return APIError(400, message, param="tool_choice", code="unsupported_parameter")


@dataclass(frozen=True, slots=True)
class ForcedCall:
    """A call the request forces: of one of ``tools``, each with the
    parameter that names its schema; one or more calls if ``parallel``,
    else exactly one."""

    tools: Sequence[tuple[str, ToolSpec]]
    parallel: bool


async def request_grammar(
    tool_format: ToolCallFormat | None,
    call: ForcedCall | None,
    answer: tuple[str, Grammar] | None,
    unforced: Callable[[str], APIError] = unforced_call,
) -> Grammar | None:
    """The grammar the answer must follow, checked; None if free: the forced
    ``call`` in the model's ``tool_format``, else ``answer`` (the parameter
    that asks for it, and its grammar).

    Raises:
        APIError: 400 naming the schema that cannot be used, or
            ``unforced(message)`` when the format cannot force the call.
    """
    if tool_format is not None and call is not None:
        for param, spec in call.tools:
            if spec.parameters is not None:
                schema = json.dumps(json_arguments(spec.parameters))
                await check_grammar(Grammar("json_schema", schema), param)
        specs = [spec for _, spec in call.tools]
        try:
            source = tool_format.grammar(specs, call.parallel)
        except UnforcedCallError as exc:  # its message names the format
            raise unforced(str(exc)) from None
        grammar = Grammar("lark", source)
        await check_grammar(grammar, "tools")
        return grammar
    if answer is None:
        return None
    param, grammar = answer
    await check_grammar(grammar, param)
    return grammar


async def check_grammar(grammar: Grammar, param: str) -> None:
    """Compile ``grammar`` off the event loop (once: the engine takes it
    from the same cache), and refuse one llguidance cannot use with a 400
    naming ``param``. Cancelling the caller abandons the compile, which
    runs to its end in its worker thread and is cached."""
    try:
        if grammar in GRAMMARS:
            GRAMMARS.compile(grammar)
        else:
            await anyio.to_thread.run_sync(
                GRAMMARS.compile, grammar, abandon_on_cancel=True
            )
    except GrammarCompileError as exc:
        first = exc.reason.strip().splitlines()[0]
        raise APIError(
            400,
            f"Invalid value for '{param}': the schema cannot be used for "
            f"constrained decoding: {first}",
            param=param,
            code="invalid_json_schema",
        ) from None


def with_budget(
    params: GenerationParams,
    facts: ChatFacts,
    template_kwargs: Mapping[str, Any],
    budget: int | None,
) -> GenerationParams:
    """``params`` with a thinking ``budget`` and the markers it forces; as
    they are without a budget, for a model with no reasoning markers, or
    for an answer under a grammar (it does not reason)."""
    reasoning = facts.formats.reasoning
    if budget is None or reasoning is None or params.grammar is not None:
        return params
    markers = reasoning.budget_markers(facts.chat_template or "", template_kwargs)
    if markers is None:
        return params
    return replace(params, thinking_budget=budget, thinking_markers=markers)
