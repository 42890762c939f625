"""Every body and server-sent event an OpenAI door answers, checked against
OpenAI's published OpenAPI document (``../shared/openai-openapi/``, beside
the repository; never copied into it).

:class:`CheckedTransport` and :class:`CheckedSyncTransport` wrap the test
clients' transports (tests/server/kit.py): a body that is not of its
schema raises :class:`ShapeMismatch` where the test reads it, and is kept
in :data:`MISMATCHES`, which an autouse fixture fails the test on (a test
that catches errors broadly cannot swallow one). The document is read, and
each schema's validator built, once per session.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import re
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import yaml
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

__all__ = [
    "ANY_OF",
    "EXCEPTIONS",
    "MISMATCHES",
    "SPEC",
    "CheckedSyncTransport",
    "CheckedTransport",
    "ShapeMismatch",
    "check_body",
    "check_event",
    "schema_of",
    "transports",
]

_ROOT = Path(__file__).resolve().parents[2]
_IN_SHARED = Path("shared", "openai-openapi", "openai-openapi.yaml")


def _spec_path() -> Path:
    """``../shared`` beside the repository; from a git worktree, beside the
    main checkout."""
    beside = _ROOT.parent / _IN_SHARED
    if beside.exists():
        return beside
    common = subprocess.run(
        ["git", "rev-parse", "--path-format=absolute", "--git-common-dir"],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    main = Path(common).parent.parent / _IN_SHARED if common else beside
    return main if main.exists() else beside


#: OpenAI's OpenAPI document, at the commit its ``.SOURCE`` file names.
SPEC = _spec_path()
_URI = "urn:openai-openapi"

_NULL = {"type": "null"}
_NULL_REASON = "OpenAI's own API sends null (the property is deprecated)"

#: Where this server's answers may differ from the document, and why: each
#: entry widens the schema at a path (``[]``: an array's items) to also
#: allow another. ``CompletionChunk`` is a legacy completion's stream
#: chunk, which the document does not describe: the SDK parses each one as a
#: ``CreateCompletionResponse``.
EXCEPTIONS: tuple[tuple[str, tuple[str, ...], dict[str, Any], str], ...] = (
    ("CreateChatCompletionResponse", ("system_fingerprint",), _NULL, _NULL_REASON),
    (
        "CreateChatCompletionStreamResponse",
        ("system_fingerprint",),
        _NULL,
        _NULL_REASON,
    ),
    ("CreateCompletionResponse", ("system_fingerprint",), _NULL, _NULL_REASON),
    (
        "CreateCompletionResponse",
        ("choices", "[]", "logprobs", "token_logprobs", "[]"),
        _NULL,
        "with echo, the prompt's first token has no log-probability: OpenAI's "
        "own API sends null there (what lm-eval reads)",
    ),
    (
        "CreateCompletionResponse",
        ("choices", "[]", "logprobs", "top_logprobs", "[]"),
        _NULL,
        "with echo, the prompt's first token has no log-probability: OpenAI's "
        "own API sends null there (what lm-eval reads)",
    ),
    (
        "CompletionChunk",
        ("choices", "[]", "finish_reason"),
        _NULL,
        "OpenAI's own stream sends null until the last chunk",
    ),
    (
        "CompletionChunk",
        ("usage",),
        _NULL,
        "OpenAI's own stream sends null until the last chunk (include_usage)",
    ),
    (
        "Embedding",
        ("embedding",),
        {"type": "string"},
        "encoding_format 'base64' makes it a base64 string",
    ),
)

#: Unions of the document read as ``anyOf`` where its ``oneOf`` overlaps:
#: a ``verbose_json`` transcription (or translation) is also a plain
#: ``json`` one.
ANY_OF = (
    "post_audio_transcriptions_200_application_json",
    "post_audio_translations_200_application_json",
)

#: The streamed events of each path the document gives none for.
_EVENTS = {"/completions": "CompletionChunk"}

#: Every mismatch seen in this session's test, whether raised or swallowed.
MISMATCHES: list[str] = []


class ShapeMismatch(AssertionError):
    """An answer of an OpenAI door is not of OpenAI's published shape."""


@functools.cache
def _document() -> dict[str, Any]:
    if not SPEC.is_file():
        raise FileNotFoundError(
            f"OpenAI's OpenAPI document is not at {SPEC}: put a checkout of "
            "github.com/openai/openai-openapi's openapi.yaml there (CI has it)"
        )
    with SPEC.open("rb") as file:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 10x faster
        document: dict[str, Any] = yaml.load(file, Loader=loader)
    _read_nullable(document["components"])
    schemas = document["components"]["schemas"]
    _name_inline_schemas(document["paths"], schemas)
    for name in ANY_OF:
        schemas[name] = {"anyOf": schemas[name].pop("oneOf")}
    for name, path, also, _ in EXCEPTIONS:
        if name == "CompletionChunk" and name not in schemas:
            # The whole body's exceptions are the chunk's too.
            schemas[name] = copy.deepcopy(schemas["CreateCompletionResponse"])
        _widen(schemas[name], path, also)
    return document


def _widen(schema: dict[str, Any], path: tuple[str, ...], also: Any) -> None:
    """``schema`` at ``path`` (through ``properties``, ``items`` and the
    object or array member of an ``anyOf``) made ``anyOf`` itself or
    ``also``."""
    step, rest = path[0], path[1:]
    if "anyOf" in schema and "properties" not in schema and "items" not in schema:
        key = "items" if step == "[]" else "properties"
        schema = next(member for member in schema["anyOf"] if key in member)
    parent = schema if step == "[]" else schema["properties"]
    key = "items" if step == "[]" else step
    if rest:
        _widen(parent[key], rest, also)
    else:
        parent[key] = {"anyOf": [parent[key], also]}


def _name_inline_schemas(paths: dict[str, Any], schemas: dict[str, Any]) -> None:
    """An answer's schema written inline (a ``oneOf`` of three
    transcriptions) moved into ``schemas``, under a name of its own."""
    for path, operations in paths.items():
        for method, operation in operations.items():
            answers = operation.get("responses", {}) if method != "parameters" else {}
            for status, answer in answers.items():
                for media, content in answer.get("content", {}).items():
                    schema = content.get("schema", {})
                    if schema and "$ref" not in schema:
                        name = re.sub(r"\W+", "_", f"{method}{path}_{status}_{media}")
                        schemas[name] = schema
                        content["schema"] = {"$ref": f"#/components/schemas/{name}"}


def _read_nullable(node: Any) -> None:
    """OpenAPI 3.0's ``nullable: true``, which the 3.1 document still has in
    places, as 3.1 says it: the schema, or null."""
    if isinstance(node, list):
        for item in node:
            _read_nullable(item)
    if not isinstance(node, dict):
        return
    for value in node.values():
        _read_nullable(value)
    if node.get("nullable") is True:
        inner = {key: value for key, value in node.items() if key != "nullable"}
        node.clear()
        node["anyOf"] = [inner, {"type": "null"}]


@functools.cache
def _registry() -> Registry[Any]:
    resource = Resource.from_contents(_document(), default_specification=DRAFT202012)
    return Registry().with_resource(_URI, resource)


@functools.cache
def _validator(name: str) -> Draft202012Validator:
    schema = {"$ref": f"{_URI}#/components/schemas/{name}"}
    return Draft202012Validator(schema, registry=_registry())


@functools.cache
def _by_type(name: str) -> dict[str, str]:
    """The members of a union schema ``name`` by the ``type`` each one
    allows (one ``enum`` value): an event is checked against its own."""
    schemas = _document()["components"]["schemas"]
    members = schemas[name].get("anyOf") or schemas[name].get("oneOf") or []
    out: dict[str, str] = {}
    for member in members:
        ref = member.get("$ref", "")
        member_name = ref.rsplit("/", 1)[-1]
        kind = schemas.get(member_name, {}).get("properties", {}).get("type", {})
        values = kind.get("enum") or ([kind["const"]] if "const" in kind else [])
        if len(values) == 1:
            out[values[0]] = member_name
    return out


def _check(name: str, instance: Any, where: str) -> None:
    if isinstance(instance, dict) and isinstance(instance.get("type"), str):
        name = _by_type(name).get(instance["type"], name)
    errors = list(_validator(name).iter_errors(instance))
    if not errors:
        return
    found = [leaf for error in errors for leaf in _leaves(error)]
    lines = [
        f"at {''.join(f'[{part!r}]' for part in leaf.absolute_path) or 'the top'}: "
        f"{leaf.message[:300]}"
        for leaf in found[:8]
    ]
    message = f"{where} is not a {name}: " + "; ".join(lines)
    message += f"\n{json.dumps(instance)[:2000]}"
    MISMATCHES.append(message)
    raise ShapeMismatch(message)


def _leaves(error: ValidationError) -> list[ValidationError]:
    """The errors that say why: of a union's members, those of the member
    whose ``type`` the instance has (or, where none says, the one that
    failed deepest)."""
    if not error.context:
        return [error]
    branches: dict[Any, list[ValidationError]] = {}
    for sub in error.context:
        branches.setdefault(sub.relative_schema_path[0], []).append(sub)
    depth = len(error.absolute_path)

    def other_kind(sub: ValidationError) -> bool:
        path = list(sub.absolute_path)
        if sub.validator == "type" and len(path) == depth:
            return True  # another JSON type altogether
        at_type = len(path) == depth + 1 and path[-1] == "type"
        return at_type and sub.validator in ("enum", "const")

    kept = [subs for subs in branches.values() if not any(map(other_kind, subs))]
    if not kept:
        return [best_match(error.context) or error]
    subs = max(kept, key=lambda subs: max(len(sub.absolute_path) for sub in subs))
    return [leaf for sub in subs for leaf in _leaves(sub)]


@functools.cache
def _paths() -> list[tuple[re.Pattern[str], str]]:
    """Each path of the document as a pattern, literal ones first."""
    out = []
    for path in _document()["paths"]:
        if "?" in path:
            continue  # a beta variant of another path
        pattern = re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(path))
        out.append((re.compile(pattern), path))
    return sorted(out, key=lambda entry: entry[1].count("{"))


def schema_of(method: str, path: str, status: int, media: str) -> str | None:
    """The schema's name of an answer to ``method path`` (``/v1/...``) with
    ``status`` and content type ``media`` (for ``text/event-stream``, its
    events'); None where the document has none (not OpenAI's path, or no
    body described)."""
    if not path.startswith("/v1/"):
        return None
    path = path[len("/v1") :]
    spec_path = next((p for pattern, p in _paths() if pattern.fullmatch(path)), None)
    if spec_path is None:
        return None
    operation = _document()["paths"][spec_path].get(method.lower())
    if operation is None:
        return None
    if status >= 400:
        return "ErrorResponse"
    answer = operation["responses"].get(str(status), {})
    content = answer.get("content", {})
    if media == "text/event-stream" and media not in content:
        return _EVENTS.get(spec_path)
    ref = content.get(media, {}).get("schema", {}).get("$ref")
    return None if ref is None else str(ref).rsplit("/", 1)[-1]


def check_body(name: str, body: bytes, where: str) -> None:
    try:
        instance = json.loads(body)
    except ValueError:
        message = f"{where} is not JSON: {body[:200]!r}"
        MISMATCHES.append(message)
        raise ShapeMismatch(message) from None
    _check(name, instance, where)


def check_event(name: str, data: str, where: str) -> None:
    """One event's ``data``: ``[DONE]`` ends a stream; an object that holds
    only ``error`` is an error chunk, an ``ErrorResponse`` (how the SDK
    reads one mid-stream)."""
    if data == "[DONE]":
        return
    try:
        instance = json.loads(data)
    except ValueError:
        message = f"an event of {where} is not JSON: {data[:200]!r}"
        MISMATCHES.append(message)
        raise ShapeMismatch(message) from None
    if isinstance(instance, dict) and set(instance) == {"error"}:
        name = "ErrorResponse"
    _check(name, instance, f"an event of {where}")


class _Checker:
    """Checks one answer's bytes as they come: each event of a stream as
    it ends, a whole body at its end."""

    def __init__(self, name: str, stream: bool, where: str) -> None:
        self.name, self.stream, self.where = name, stream, where
        self.buffer = b""

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        if not self.stream:
            return
        text = self.buffer.replace(b"\r\n", b"\n")
        *blocks, rest = text.split(b"\n\n")
        self.buffer = rest
        for block in blocks:
            lines = block.decode().split("\n")
            data = [line[5:].removeprefix(" ") for line in lines if line[:5] == "data:"]
            if data:
                check_event(self.name, "\n".join(data), self.where)

    def end(self) -> None:
        if not self.stream:
            check_body(self.name, self.buffer, self.where)


def _checker(request: Any, response: Any) -> _Checker | None:
    media = response.headers.get("content-type", "").split(";")[0].strip()
    if response.status_code >= 400:
        media = "application/json"  # an error must be OpenAI's JSON body too
    elif media not in ("application/json", "text/event-stream"):
        return None  # audio
    name = schema_of(request.method, request.url.path, response.status_code, media)
    if name is None:
        return None
    where = f"{request.method} {request.url.path} ({response.status_code})"
    return _Checker(name, media == "text/event-stream", where)


@functools.cache
def transports(http: ModuleType = httpx) -> tuple[type[Any], type[Any]]:
    """The checking transports of ``http`` (httpx, or the httpx2 that the
    openai SDK uses): an async one and a blocking one, each wrapping an
    inner transport (the blocking one's default: a plain HTTP one)."""

    class CheckedStream(http.AsyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, inner: Any, checker: _Checker) -> None:
            self.inner, self.checker = inner, checker

        async def __aiter__(self) -> AsyncIterator[bytes]:
            # Closed here, not by the garbage collector, when a check fails
            # mid-stream: trio reports an async generator left open.
            async with contextlib.aclosing(aiter(self.inner)) as chunks:
                async for chunk in chunks:
                    self.checker.feed(chunk)
                    yield chunk
            self.checker.end()

        async def aclose(self) -> None:
            await self.inner.aclose()

    class CheckedSyncStream(http.SyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, inner: Any, checker: _Checker) -> None:
            self.inner, self.checker = inner, checker

        def __iter__(self) -> Iterator[bytes]:
            for chunk in self.inner:
                self.checker.feed(chunk)
                yield chunk
            self.checker.end()

        def close(self) -> None:
            self.inner.close()

    def wrapped(request: Any, response: Any, stream: type[Any]) -> Any:
        checker = _checker(request, response)
        if checker is None:
            return response
        return http.Response(
            response.status_code,
            headers=response.headers,
            stream=stream(response.stream, checker),
            extensions=response.extensions,
            request=request,
        )

    class CheckedTransport(http.AsyncBaseTransport):  # type: ignore[name-defined,misc]
        def __init__(self, inner: Any = None) -> None:
            self.inner = inner or http.AsyncHTTPTransport()

        async def handle_async_request(self, request: Any) -> Any:
            response = await self.inner.handle_async_request(request)
            return wrapped(request, response, CheckedStream)

        async def aclose(self) -> None:
            await self.inner.aclose()

    class CheckedSyncTransport(http.BaseTransport):  # type: ignore[name-defined,misc]
        def __init__(self, inner: Any = None) -> None:
            self.inner = inner or http.HTTPTransport()

        def handle_request(self, request: Any) -> Any:
            response = self.inner.handle_request(request)
            return wrapped(request, response, CheckedSyncStream)

        def close(self) -> None:
            self.inner.close()

    return CheckedTransport, CheckedSyncTransport


#: httpx's transports, checked: ``CheckedTransport(httpx.ASGITransport(app))``.
CheckedTransport, CheckedSyncTransport = transports(httpx)
