"""The bodies of vLLM's ``/tokenize`` and ``/detokenize``. Pure CPU, any
thread. ``/tokenize`` takes a raw prompt, as ``/v1/completions`` tokenizes
it, or chat messages (text only), as ``/v1/chat/completions`` renders them."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from ...events import GenerationParams
from ..protocol_common import RequestBody, RequestModel, TemplateKwargs, TextPart
from ..validation import parse_request

__all__ = [
    "DetokenizeRequest",
    "TokenizeChatRequest",
    "TokenizePromptRequest",
    "parse_tokenize_request",
]


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def chat_message(self) -> dict[str, Any]:
        content = self.content
        if self.role == "user":
            if isinstance(content, str):
                return {"role": "user", "content": content}
            parts = [{"type": "text", "text": part.text} for part in content]
            return {"role": "user", "content": parts}
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content}


class TokenizePromptRequest(RequestBody):
    model: str
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False

    def to_generation_params(self) -> GenerationParams:
        return GenerationParams(
            messages=(),
            prompt=self.prompt,
            add_special_tokens=self.add_special_tokens,
            max_tokens=1,
        )


class TokenizeChatRequest(RequestBody):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: TemplateKwargs | None = None
    return_token_strs: bool = False

    @field_validator("add_special_tokens")
    @classmethod
    def _check_special(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "the chat template adds the model's special tokens; leave it false"
            )
        return value

    def to_generation_params(self) -> GenerationParams:
        kwargs = dict(self.chat_template_kwargs or {})
        if not self.add_generation_prompt:
            kwargs["add_generation_prompt"] = False
        return GenerationParams(
            messages=tuple(message.chat_message() for message in self.messages),
            max_tokens=1,
            template_kwargs=tuple(kwargs.items()),
        )


class DetokenizeRequest(RequestBody):
    model: str
    tokens: list[Annotated[int, Field(ge=0)]]


def parse_tokenize_request(body: bytes) -> TokenizePromptRequest | TokenizeChatRequest:
    """A ``/tokenize`` body: chat messages if it has ``messages`` (as vLLM
    tells them), else a prompt."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # pydantic's parse names the fault
        data = None
    if isinstance(data, dict) and "messages" in data:
        return parse_request(TokenizeChatRequest, body)
    return parse_request(TokenizePromptRequest, body)
