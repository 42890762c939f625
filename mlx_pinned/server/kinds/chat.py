"""The chat kind: the continuous batch of :mod:`..engine` and the doors of
:mod:`..http`. Any thread; both are imported only when the server is built."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..events import Engine
from . import Kind

if TYPE_CHECKING:
    from pathlib import Path

    from mlx_pinned import MLXThread

    from ..config import ModelSettings


def _load(settings: ModelSettings, thread: MLXThread) -> Any:
    from ..engine import BatchEngine

    return BatchEngine.load(settings, thread)


def _routes(wiring: Any) -> list[Any]:
    from ..http.anthropic_messages import CountTokensEndpoint, MessagesEndpoint
    from ..http.chat_completions import ChatCompletionsEndpoint
    from ..http.completions import CompletionsEndpoint
    from ..http.door import routes
    from ..http.ollama import ChatEndpoint, GenerateEndpoint
    from ..http.responses_api import ResponsesEndpoint
    from ..http.responses_api import routes as stored
    from ..http.tokenize import DetokenizeEndpoint, TokenizeEndpoint

    doors = (
        ChatCompletionsEndpoint,
        CompletionsEndpoint,
        TokenizeEndpoint,
        DetokenizeEndpoint,
        MessagesEndpoint,
        CountTokensEndpoint,
        ChatEndpoint,
        GenerateEndpoint,
    )
    return [
        *routes(*(door(wiring) for door in doors)),
        *stored(ResponsesEndpoint(wiring)),
    ]


def _demo() -> Path:
    from mlx_pinned.testing import tiny_vlm_path

    return tiny_vlm_path()


KIND = Kind(
    name="chat",
    what="a chat model",
    paths=("/v1/chat/completions",),
    protocol=Engine,
    settings=frozenset(
        {
            "tool_call_parser",
            "reasoning_parser",
            "prompt_cache_bytes",
            "image_cache_bytes",
            "prefill_step_size",
            "prefill_step_seconds",
            "prefill_checkpoint_tokens",
            "abandoned_prefill_tokens",
            "kv_bits",
            "kv_group_size",
            "prompt_lookup_tokens",
            "num_draft_tokens",
            "draft_model",
            "mtp",
            "draft_max_batch",
        }
    ),
    load=_load,
    routes=_routes,
    demo=_demo,
)
