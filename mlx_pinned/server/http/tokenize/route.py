"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

Event loop. Each is a :class:`~..endpoint.ModelEndpoint` that
generates nothing: the base reads the body, keeps the deadline, holds the
model named by ``model`` (404 otherwise) and answers every error in
OpenAI's shape, as the generation routes do; the tokenizer runs on the MLX
thread, through the engine (:meth:`~...events.Engine.tokenize`), between
steps of the batch. A prompt is tokenized exactly as a generation of it
would be, so ``/tokenize`` of chat messages gives the ids
``/v1/chat/completions`` prefills, which ``/v1/completions`` takes as its
``prompt``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ...failures import PromptTooLongError
from ...limits import check_text_length
from ..endpoint import ModelEndpoint
from ..errors import APIError
from ..slots import Capabilities
from ..validation import parse_request
from .protocol import DetokenizeRequest, TokenizeChatRequest, parse_tokenize_request

if TYPE_CHECKING:
    from ..wire import RequestLog, ResponseWriter

__all__ = ["DetokenizeEndpoint", "TokenizeEndpoint"]


class TokenizeEndpoint(ModelEndpoint):
    """The ASGI endpoint of ``POST /tokenize``: ``{"count", "max_model_len",
    "tokens"}``, and ``token_strs`` (each token's text, as log-probabilities
    show it) when ``return_token_strs`` is true."""

    route = "POST /tokenize"

    async def handle(
        self, body: bytes, response: ResponseWriter, log: RequestLog, images: list[str]
    ) -> None:
        request = parse_tokenize_request(body)
        async with self.model(request.model, log) as (served, engine):
            capabilities = Capabilities.of(engine, served)
            limit = self.config.max_prompt_tokens or capabilities.context_length
            param = "prompt"
            if isinstance(request, TokenizeChatRequest):
                param = "messages"
                chars = sum(
                    len(m.content)
                    if isinstance(m.content, str)
                    else sum(len(p.text) for p in m.content)
                    for m in request.messages
                )
            else:
                chars = len(request.prompt)
            try:
                if limit is not None:
                    # Refused before the MLX thread spends time on it.
                    check_text_length(chars, capabilities.longest_token_chars, limit)
            except PromptTooLongError as exc:
                raise APIError(400, exc.message, param=param, code=exc.code) from None
            tokens = await engine.tokenize(request.to_generation_params())
            log.prompt_tokens = len(tokens)
            answer: dict[str, object] = {
                "count": len(tokens),
                "max_model_len": capabilities.context_length,
                "tokens": [token for token, _ in tokens],
            }
            if request.return_token_strs:
                answer["token_strs"] = [text for _, text in tokens]
            await response.json(json.dumps(answer, ensure_ascii=False).encode())


class DetokenizeEndpoint(ModelEndpoint):
    """The ASGI endpoint of ``POST /detokenize``: ``{"prompt"}``, the text
    of ``tokens`` (at most the model's context of them)."""

    route = "POST /detokenize"

    async def handle(
        self, body: bytes, response: ResponseWriter, log: RequestLog, images: list[str]
    ) -> None:
        request = parse_request(DetokenizeRequest, body)
        async with self.model(request.model, log) as (_, engine):
            vocab, context = engine.vocab_size, engine.context_length
            if context is not None and len(request.tokens) > context:
                # More than any prompt or answer could hold: refused before
                # the MLX thread spends time on it.
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
            text = await engine.detokenize(request.tokens)
            body_out = json.dumps({"prompt": text}, ensure_ascii=False)
            await response.json(body_out.encode())
