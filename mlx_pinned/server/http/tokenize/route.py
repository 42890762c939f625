"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes. Event
loop; they take no turn of the gate. A prompt is tokenized exactly as a
generation of it would be."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeAlias

from ...events import Engine
from ...failures import PromptTooLongError
from ...limits import check_text_length
from ..door import Call, Door
from ..errors import APIError
from ..validation import parse_request
from .protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizePromptRequest,
    parse_tokenize_request,
)

__all__ = ["DetokenizeEndpoint", "TokenizeEndpoint"]

_Tokens: TypeAlias = tuple[tuple[int, str], ...]
TokenizeRequest: TypeAlias = TokenizePromptRequest | TokenizeChatRequest


class TokenizeEndpoint(Door[TokenizeRequest, Engine, TokenizeRequest, _Tokens]):
    route = "POST /tokenize"
    prompt = "prompt"
    gated = False

    async def parse(self, body: bytes, places: list[str]) -> TokenizeRequest:
        return parse_tokenize_request(body)

    async def prepare(
        self, request: TokenizeRequest, engine: Engine
    ) -> TokenizeRequest:
        """Refuse a text over the prompt limit before the MLX thread spends
        time on it."""
        facts = engine.facts
        limit = self.config.max_prompt_tokens or facts.context_length
        if isinstance(request, TokenizeChatRequest):
            param = "messages"
            chars = sum(
                len(m.content)
                if isinstance(m.content, str)
                else sum(len(p.text) for p in m.content)
                for m in request.messages
            )
        else:
            param, chars = "prompt", len(request.prompt)
        try:
            if limit is not None:
                check_text_length(chars, facts.longest_token_chars, limit)
        except PromptTooLongError as exc:
            raise APIError(400, exc.message, param=param, code=exc.code) from None
        return request

    @asynccontextmanager
    async def run(
        self, call: Call[TokenizeRequest, Engine, TokenizeRequest]
    ) -> AsyncIterator[_Tokens]:
        yield await call.engine.tokenize(call.request.to_generation_params())

    async def send_whole(
        self, call: Call[TokenizeRequest, Engine, TokenizeRequest], output: _Tokens
    ) -> None:
        call.log.prompt_tokens = len(output)
        answer: dict[str, object] = {
            "count": len(output),
            "max_model_len": call.engine.facts.context_length,
            "tokens": [token for token, _ in output],
        }
        if call.request.return_token_strs:
            answer["token_strs"] = [text for _, text in output]
        await call.response.json(json.dumps(answer, ensure_ascii=False).encode())


class DetokenizeEndpoint(Door[DetokenizeRequest, Engine, DetokenizeRequest, str]):
    route = "POST /detokenize"
    prompt = "tokens"
    gated = False

    async def parse(self, body: bytes, places: list[str]) -> DetokenizeRequest:
        return parse_request(DetokenizeRequest, body)

    async def prepare(
        self, request: DetokenizeRequest, engine: Engine
    ) -> DetokenizeRequest:
        """Refuse more tokens than any prompt or answer could hold, and ids
        outside the vocabulary, before the MLX thread spends time on them."""
        vocab, context = engine.facts.vocab_size, engine.facts.context_length
        if context is not None and len(request.tokens) > context:
            raise APIError(
                400,
                f"Invalid value for 'tokens': {len(request.tokens)} tokens "
                f"are more than this model's context of {context}.",
                param="tokens",
                code="invalid_value",
            )
        for token in request.tokens:
            if token >= vocab:
                raise APIError(
                    400,
                    f"Invalid value for 'tokens': token id {token} is outside "
                    f"the vocabulary (0 to {vocab - 1}).",
                    param="tokens",
                    code="invalid_value",
                )
        return request

    @asynccontextmanager
    async def run(
        self, call: Call[DetokenizeRequest, Engine, DetokenizeRequest]
    ) -> AsyncIterator[str]:
        yield await call.engine.detokenize(call.request.tokens)

    async def send_whole(
        self, call: Call[DetokenizeRequest, Engine, DetokenizeRequest], output: str
    ) -> None:
        body = json.dumps({"prompt": output}, ensure_ascii=False)
        await call.response.json(body.encode())
