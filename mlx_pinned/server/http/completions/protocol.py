"""The body of OpenAI's legacy ``POST /v1/completions``, with vLLM's
extensions. Pure CPU, any thread. Every field is honoured, accepted without
effect (``user``) or refused by name (``suffix``, ``n`` and ``best_of``
above 1)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from ...events import GenerationParams, Grammar
from ..protocol_common import (
    OpenAISamplingFields,
    StreamOptions,
    TextsOrTokens,
    unsupported,
)
from ..validation import parse_request
from ..vllm_extensions import StructuredOutputFields

__all__ = [
    "MAX_PROMPTS",
    "OPENAI_DEFAULT_MAX_TOKENS",
    "CompletionRequest",
    "parse_completion_request",
]

#: Prompts one request may send (each is a choice, a row of its own).
MAX_PROMPTS = 64
#: ``max_tokens`` of a request that sets none, as OpenAI's reference says.
OPENAI_DEFAULT_MAX_TOKENS = 16


class CompletionRequest(OpenAISamplingFields, StructuredOutputFields):
    model: str
    prompt: TextsOrTokens
    max_tokens: int | None = Field(default=None, ge=0)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = None
    n: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    # No effect on the output by definition: accepted, unused.
    user: str | None = None
    # vLLM's extension, honoured (its sampling ones are shared).
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and isinstance(value[0], str | list):
            if len(value) > MAX_PROMPTS:
                raise ValueError(
                    f"at most {MAX_PROMPTS} prompts are allowed, not {len(value)}"
                )
        return value

    @field_validator("n")
    @classmethod
    def _check_n(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise unsupported(
                "n",
                "this server returns one choice per prompt; send the prompt "
                "several times in 'prompt' (a list) for several choices",
            )
        return value

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise unsupported(
                "best_of", "this server generates one completion per prompt"
            )
        return value

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, value: str | None) -> str | None:
        if value:
            raise unsupported("suffix", "this server has no fill-in-the-middle")
        return value

    @property
    def scored(self) -> int | None:
        """Alternatives per prompt token its log-probabilities list: vLLM's
        ``prompt_logprobs``, or ``logprobs`` with ``echo`` (the prompt's
        tokens come first in the legacy lists); None: not computed."""
        wanted = [self.prompt_logprobs]
        if self.echo and (self.logprobs is not None or self.max_tokens == 0):
            wanted.append(self.logprobs or 0)
        given = [k for k in wanted if k is not None]
        return max(given) if given else None

    @property
    def prompts(self) -> list[str | tuple[int, ...]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [tuple(prompt)]
        return [p if isinstance(p, str) else tuple(p) for p in prompt]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_generation_params(
        self,
        prompt: str | tuple[int, ...],
        max_tokens: int,
        *,
        max_prompt_tokens: int | None = None,
        context_length: int | None = None,
        grammar: Grammar | None = None,
    ) -> GenerationParams:
        """One prompt of this request as the shared generation request: the
        prompt raw, without the chat template."""
        return GenerationParams(
            messages=(),
            prompt=prompt,
            add_special_tokens=self.add_special_tokens,
            max_tokens=max_tokens,
            sampling=self.sampling_params(
                logprobs=self.logprobs is not None,
                top_logprobs=self.logprobs or 0,
                scored=self.scored,
            ),
            **self.generation_fields(),
            max_prompt_tokens=max_prompt_tokens,
            context_length=context_length,
            grammar=grammar,
        )


def parse_completion_request(body: bytes) -> CompletionRequest:
    """Raises :class:`~..errors.APIError`, a 400 naming the first invalid
    parameter."""
    return parse_request(CompletionRequest, body)
