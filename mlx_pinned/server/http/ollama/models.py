"""Ollama's routes that name no door's work: ``/api/tags``, ``/api/show``,
``/api/ps``, the version, ``/``, and the model management this server does
not do (pull, push, create...), refused with what it does instead.
Event loop; a model's ``config.json`` is read in a worker thread, once."""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ...events import ChatFacts
from ...kinds.embedding.values import EmbeddingFacts
from ..errors import APIError
from ..served_models import SlotState, expires_at
from ..validation import parse_request
from ..wire import Disconnected, read_body
from .output import NDJSON, OLLAMA_ERRORS, created_at, line
from .protocol import ShowRequest

if TYPE_CHECKING:
    from starlette.requests import Request

    from ..door import Wiring
    from ..served_models import ServedModel

__all__ = ["OLLAMA_VERSION", "OllamaModels"]

#: The Ollama release whose API this server follows (``/api/version``).
OLLAMA_VERSION = "0.13.0"
#: The kinds Ollama's API serves; the others are not listed.
KINDS = ("chat", "embedding")
# Ollama's "never": now plus the longest Go duration.
_NEVER = (2**63 - 1) / 1e9
_INSTEAD = (
    "models are served from paths or hub ids given to `mlx-pinned serve` or "
    "in its --config file, read at start-up"
)


def tagged(name: str) -> str:
    """A served name as Ollama lists it: with a tag (``:latest``)."""
    return name if ":" in name.rpartition("/")[2] else f"{name}:latest"


class OllamaModels:
    """The model-independent routes, for one app."""

    def __init__(self, wiring: Wiring) -> None:
        self.wiring = wiring
        self.paths = dict(zip(wiring.config.names, wiring.config.models, strict=True))
        self._configs: dict[str, dict[str, Any]] = {}

    def routes(self) -> list[Route]:
        """Every route but ``/``, which goes after the playground's."""
        found = [
            _route("/api/tags", self.tags, "GET"),
            _route("/api/ps", self.ps, "GET"),
            _route("/api/version", self.version, "GET"),
            _route("/api/show", self.show, "POST"),
            _route("/api/pull", self.pull, "POST"),
        ]
        refused = {
            "/api/push": ("POST", "this server publishes no models"),
            "/api/create": ("POST", "this server creates no models"),
            "/api/copy": (
                "POST",
                "this server copies no models; a model's name is "
                "its --served-model-name",
            ),
            "/api/delete": (
                "DELETE",
                "this server deletes no models; to free a "
                "model's memory, unload it (keep_alive 0, or POST "
                "/v1/models/{name}/unload)",
            ),
            "/api/blobs/{digest}": ("POST", "this server keeps no blobs"),
        }
        for path, (method, why) in refused.items():
            methods = [method, "HEAD"] if path.startswith("/api/blobs") else [method]
            found.append(_route(path, functools.partial(_refuse, why), *methods))
        return found

    @staticmethod
    def root() -> Route:
        return Route("/", _running, methods=["GET", "HEAD"])

    def _listed(self) -> list[ServedModel]:
        return [model for model in self.wiring.models if model.kind in KINDS]

    async def _config(self, served: ServedModel) -> dict[str, Any]:
        """Its ``config.json`` (empty where it cannot be read)."""
        name = served.name
        if name not in self._configs:
            read = functools.partial(_read_config, self.paths[name])
            self._configs[name] = await anyio.to_thread.run_sync(read)
        return self._configs[name]

    async def _details(self, served: ServedModel) -> dict[str, Any]:
        config = await self._config(served)
        family = str(config.get("model_type", ""))
        bits = (config.get("quantization") or {}).get("bits")
        level = f"Q{bits}" if bits else str(config.get("torch_dtype", "")).upper()
        return {
            "parent_model": "",
            "format": "safetensors",
            "family": family,
            "families": [family] if family else None,
            "parameter_size": "",
            "quantization_level": level.replace("BFLOAT", "BF").replace("FLOAT", "F"),
        }

    async def _size(self, served: ServedModel) -> int:
        slot = served.slot
        if slot.weight_bytes is None:  # measured from its files, on the MLX thread
            slot.weight_bytes = await slot.measure()
        return slot.weight_bytes

    def _digest(self, served: ServedModel) -> str:
        source = f"{served.name}\0{self.paths[served.name]}".encode()
        return hashlib.sha256(source).hexdigest()

    async def tags(self, request: Request) -> Response:
        models = [
            {
                "name": tagged(served.name),
                "model": tagged(served.name),
                "modified_at": created_at(served.slot.created),
                "size": await self._size(served),
                "digest": self._digest(served),
                "details": await self._details(served),
            }
            for served in self._listed()
        ]
        return JSONResponse({"models": models})

    async def ps(self, request: Request) -> Response:
        models = []
        for served in self._listed():
            slot = served.slot
            if slot.state not in (SlotState.LOADED, SlotState.DRAINING):
                continue
            expires = expires_at(slot)
            size = slot.weight_bytes or 0
            models.append(
                {
                    "name": tagged(served.name),
                    "model": tagged(served.name),
                    "size": size,
                    "digest": self._digest(served),
                    "details": await self._details(served),
                    "expires_at": created_at(
                        time.time() + _NEVER if expires is None else expires
                    ),
                    "size_vram": size,
                    "context_length": _context(served),
                }
            )
        return JSONResponse({"models": models})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_VERSION})

    async def show(self, request: Request) -> Response:
        shown = parse_request(ShowRequest, await self._body(request))
        served = self.wiring.models.get(shown.named)
        if served.kind not in KINDS:
            raise APIError(
                400,
                f"The model {served.name!r} is served by the OpenAI API only: "
                "see /v1/models.",
                param="model",
            )
        config = await self._config(served)
        facts = served.slot.facts
        template = facts.chat_template if isinstance(facts, ChatFacts) else None
        answer = {
            "license": "",
            "modelfile": "",
            "parameters": "",
            "template": template or "",
            "details": await self._details(served),
            "model_info": _model_info(config, _context(served)),
            "capabilities": _capabilities(served),
            "modified_at": created_at(served.slot.created),
        }
        return JSONResponse(answer)

    async def pull(self, request: Request) -> Response:
        try:
            asked = json.loads(await self._body(request) or b"{}")
        except ValueError:
            asked = None
        if not isinstance(asked, dict):
            raise APIError(400, "The body must be a JSON object.", code="invalid_json")
        name = asked.get("model") or asked.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "Missing required parameter: 'model'.", param="model")
        self.wiring.models.get(name)  # a 404 for a model not served
        body = line({"status": "success"})
        if asked.get("stream") is False:
            return Response(body, media_type="application/json")
        return Response(body, media_type=NDJSON.decode())

    async def _body(self, request: Request) -> bytes:
        try:
            return await read_body(
                request.scope, request.receive, self.wiring.config.max_body_bytes
            )
        except Disconnected:
            raise APIError(400, "The client left before its body was sent.") from None


def _route(
    path: str, endpoint: Callable[..., Awaitable[Response]], *methods: str
) -> Route:
    """A route whose refusals are in Ollama's shape (the error edge reads
    its endpoint's ``errors``)."""
    handler = functools.partial(endpoint)
    handler.errors = OLLAMA_ERRORS  # type: ignore[attr-defined]
    return Route(path, handler, methods=list(methods))


async def _refuse(why: str, request: Request) -> Response:
    raise APIError(403, f"{why[0].upper()}{why[1:]}: {_INSTEAD}.")


async def _running(request: Request) -> Response:
    return PlainTextResponse("Ollama is running")


def _read_config(path: str) -> dict[str, Any]:
    """``config.json`` of a model folder, or of a hub id in the local cache."""
    found: Path | None = Path(path) / "config.json"
    if found is not None and not found.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
        except Exception:  # not a valid hub id: nothing to read
            cached = None
        found = Path(cached) if isinstance(cached, str) else None
    if found is None:
        return {}
    try:
        config = json.loads(found.read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _context(served: ServedModel) -> int | None:
    facts = served.slot.facts
    if isinstance(facts, ChatFacts):
        return facts.context_length
    if isinstance(facts, EmbeddingFacts):
        return facts.max_input_tokens
    return None


def _capabilities(served: ServedModel) -> list[str]:
    """What Ollama's clients look for, from the model's facts at its last
    load (before any, its kind's alone)."""
    facts = served.slot.facts
    if isinstance(facts, ChatFacts):
        found = {
            "completion": True,
            "vision": facts.accepts_images,
            "tools": facts.formats.tool_call is not None,
            "thinking": facts.formats.reasoning is not None,
        }
        return [name for name, has in found.items() if has]
    if isinstance(facts, EmbeddingFacts):
        return ["embedding", *(["vision"] if facts.accepts_images else [])]
    return ["completion"] if served.kind == "chat" else ["embedding"]


def _model_info(config: dict[str, Any], context: int | None) -> dict[str, Any]:
    """The config's numbers under Ollama's keys (``<family>.block_count``)."""
    family = str(config.get("model_type", ""))
    text = config.get("text_config") or config
    keys = {
        "context_length": context or text.get("max_position_embeddings"),
        "embedding_length": text.get("hidden_size"),
        "block_count": text.get("num_hidden_layers"),
        "feed_forward_length": text.get("intermediate_size"),
        "attention.head_count": text.get("num_attention_heads"),
        "attention.head_count_kv": text.get("num_key_value_heads"),
        "rope.freq_base": text.get("rope_theta"),
        "vocab_size": text.get("vocab_size"),
    }
    info: dict[str, Any] = {"general.architecture": family}
    info |= {
        f"{family}.{key}": value for key, value in keys.items() if value is not None
    }
    return info
