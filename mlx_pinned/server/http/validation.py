"""Request bodies parsed with pydantic, its errors as 400 :class:`APIError`.

Event loop (pure CPU). Every API parses its body with :func:`parse_request`,
so a bad body is answered alike on every route, in the route's own shape.
"""

from __future__ import annotations

import functools
import json
import typing
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from .errors import APIError

__all__ = ["field_names", "parse_request", "validation_error_to_api_error"]

Model = TypeVar("Model", bound=BaseModel)


def parse_request(model: type[Model], body: bytes) -> Model:
    """Raises :class:`APIError`, a 400 naming the first invalid parameter."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error_to_api_error(exc, body, field_names(model)) from None


@functools.cache
def field_names(model: type[BaseModel]) -> frozenset[str]:
    """Every field name (its alias, where it has one) of ``model`` and of
    the models its fields hold, at any depth."""
    names: set[str] = set()
    seen: set[type[BaseModel]] = set()
    todo: list[Any] = [model]
    while todo:
        item = todo.pop()
        if isinstance(item, type) and issubclass(item, BaseModel):
            if item not in seen:
                seen.add(item)
                for name, field in item.model_fields.items():
                    names.add(field.alias or name)
                    todo.append(field.annotation)
        else:  # list[X], X | None, Annotated[X, ...]: look inside
            todo.extend(typing.get_args(item))
    return frozenset(names)


def validation_error_to_api_error(
    exc: ValidationError, body: bytes, field_names: frozenset[str]
) -> APIError:
    """A 400 :class:`APIError` for the most specific error of ``exc``;
    ``field_names`` tells a missing field from one of pydantic's union
    labels."""
    errors = exc.errors(include_url=False, include_context=False)
    if any(e["type"] == "json_invalid" for e in errors):
        return APIError(
            400,
            "We could not parse the JSON body of your request: send valid JSON.",
            code="invalid_json",
        )
    try:
        data: Any = json.loads(body)
    except ValueError:  # pragma: no cover - pydantic parsed it already
        data = None
    paths = [_param_path(e["loc"], data, field_names) for e in errors]
    path = max(paths, key=len)
    # A union (string or list) fails once per member at the same path.
    same = [e for e, p in zip(errors, paths, strict=True) if p == path]
    best = same[-1]
    texts = list(
        dict.fromkeys(str(e["msg"]).removeprefix("Value error, ") for e in same)
    )
    message = ", or ".join([texts[0], *(t[:1].lower() + t[1:] for t in texts[1:])])
    if best["type"] == "extra_forbidden" and len(path) == 1:
        # OpenAI's own words for a top-level field it does not know.
        name = _dotted(path)
        return APIError(
            400,
            f"Unrecognized request argument supplied: {name}.",
            param=name,
            code="unknown_parameter",
        )
    if best["type"] in _WHOLE_SENTENCES:
        text = texts[0]
    elif best["type"] == "missing":
        text = f"Missing required parameter: '{_dotted(path)}'."
    elif path:
        text = f"Invalid value for '{_dotted(path)}': {message}."
    else:
        text = f"Invalid request body: {message}."
    code = _code(best["type"])
    if best["type"] == "too_short" and best.get("input") == []:
        code = "empty_array"  # as OpenAI names it
    return APIError(400, text, param=_dotted(path) or None, code=code)


#: Our own error types (pydantic_core.PydanticCustomError): the message is the
#: whole sentence and the type is the code.
_WHOLE_SENTENCES = frozenset({"unsupported_parameter", "unsupported_value"})


def _code(error_type: str) -> str:
    if error_type in _WHOLE_SENTENCES:
        return error_type
    if error_type == "missing":
        return "missing_required_parameter"
    if error_type.endswith("_type") or error_type in {
        "union_tag_invalid",
        "literal_error",
    }:
        return "invalid_type"
    return "invalid_value"


def _param_path(
    loc: tuple[int | str, ...], data: Any, field_names: frozenset[str]
) -> list[int | str]:
    """Drop pydantic's union labels (``'user'``, ``'list[...]'``) from
    ``loc`` by walking the request data: OpenAI names the path in the
    request."""
    path: list[int | str] = []
    current = data
    for i, item in enumerate(loc):
        if isinstance(current, dict) and isinstance(item, str) and item in current:
            current = current[item]
            path.append(item)
        elif (
            isinstance(current, list) and isinstance(item, int) and item < len(current)
        ):
            current = current[item]
            path.append(item)
        elif i == len(loc) - 1:
            # A missing field is named only as the last element and only if it
            # is a real field, not a union label such as 'str' or 'user'.
            if isinstance(current, dict) and item in field_names:
                path.append(item)
        elif not isinstance(item, str) or not isinstance(current, (dict, list)):
            break
    return path


def _dotted(path: list[int | str]) -> str:
    out = ""
    for item in path:
        out += f"[{item}]" if isinstance(item, int) else f".{item}" if out else item
    return out
