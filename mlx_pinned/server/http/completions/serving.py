"""Completions' one check against the model: a parsed request against the
model's :class:`~...events.ChatFacts` and this server's limits, before any
prompt waits for the gate, turned into a generation request per prompt.
Event loop. A text prompt's exact length in tokens is checked by the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import APIError
from ..serving_common import (
    check_prompt_text,
    check_scored_stream,
    check_token_fields,
    max_tokens,
    out_of_vocabulary,
    request_grammar,
)
from .protocol import OPENAI_DEFAULT_MAX_TOKENS

if TYPE_CHECKING:
    from ...config import ServerConfig
    from ...events import ChatFacts, Engine, GenerationParams
    from .protocol import CompletionRequest

__all__ = ["CompletionsServing", "Prompts"]


@dataclass(frozen=True, slots=True)
class Prompts:
    """A request checked against its model: a generation per prompt, and the
    text each choice starts with (its prompt with ``echo``, else empty)."""

    params: list[GenerationParams]
    echoes: list[str]


class CompletionsServing:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config

    async def prepare(
        self, request: CompletionRequest, facts: ChatFacts, engine: Engine
    ) -> Prompts:
        """``engine`` decodes token prompts that are echoed. Raises an
        ``APIError`` naming the parameter at fault, or a ``PromptTooLongError``.
        """
        max_prompt = self.config.max_prompt_tokens or facts.context_length
        # OpenAI's default (16), within the server's limit.
        limit = self.config.max_tokens_limit or OPENAI_DEFAULT_MAX_TOKENS
        least = min(OPENAI_DEFAULT_MAX_TOKENS, limit)
        most = max_tokens(self.config, "max_tokens", request.max_tokens, default=least)
        if most == 0 and not request.echo:
            raise APIError(
                400,
                "Invalid value for 'max_tokens': 0 generates nothing; it needs "
                "'echo' (the prompt, and its log-probabilities with 'logprobs').",
                param="max_tokens",
                code="invalid_value",
            )
        vocab = facts.vocab_size
        grammar = await request_grammar(None, None, request.structured_grammar())
        params: list[GenerationParams] = []
        echoes: list[str] = []
        for prompt in request.prompts:
            one = request.to_generation_params(
                prompt,
                most,
                max_prompt_tokens=max_prompt,
                context_length=facts.context_length,
                grammar=grammar,
            )
            check_token_fields(one, vocab)
            check_scored_stream(one, request.stream)
            # A prompt to be cut is checked once cut, by the engine.
            cut = request.truncate_prompt_tokens is not None
            if isinstance(prompt, str):
                if not cut:
                    check_prompt_text(self.config, facts, len(prompt))
                echo = prompt
            else:
                for token_id in prompt:
                    if token_id >= vocab:
                        raise out_of_vocabulary("prompt", token_id, vocab)
                if not cut:
                    one.max_tokens_for(len(prompt))  # refused before it waits
                echo = await engine.detokenize(prompt) if request.echo else ""
            params.append(one)
            echoes.append(echo if request.echo else "")
        return Prompts(params, echoes)
