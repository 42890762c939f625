"""The form of OpenAI's ``POST /v1/audio/transcriptions`` and
``/v1/audio/translations``, as a pydantic model. Event loop. A multipart
form as OpenAI's SDK sends it, its text values converted to each field's
type as OpenAI's API does."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ...http.errors import APIError
from ...http.validation import field_names, validation_error_to_api_error

__all__ = [
    "MAX_PROMPT_CHARS",
    "ResponseFormat",
    "TranscriptionForm",
    "TranslationForm",
    "parse_form",
]

ResponseFormat = Literal["json", "text", "srt", "verbose_json", "vtt"]
#: The longest ``prompt`` taken (Whisper reads its last 223 tokens).
MAX_PROMPT_CHARS = 4096
# The form's repeated fields: by the names OpenAI's SDK sends them as, and
# by the OpenAPI document's own (a part for each value, under the plain name).
_LISTS = {
    "timestamp_granularities[]": "timestamp_granularities",
    "timestamp_granularities": "timestamp_granularities",
    "include[]": "include",
    "include": "include",
}


class TranslationForm(BaseModel):
    """The form of ``POST /v1/audio/translations`` (its file aside)."""

    # Lax: every value of a form is text ("0.2", "true"), as OpenAI reads it.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    model: str = Field(min_length=1)
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    response_format: ResponseFormat = "json"
    temperature: float = Field(default=0.0, ge=0.0, le=1.0)


class TranscriptionForm(TranslationForm):
    """The form of ``POST /v1/audio/transcriptions`` (its file aside)."""

    language: str | None = None
    stream: bool = False
    timestamp_granularities: tuple[Literal["word", "segment"], ...] = ()
    # Where the windows fall: Whisper's 30-second windows are the server's
    # own choice, which is what "auto" asks for.
    chunking_strategy: Literal["auto"] | None = None

    @field_validator("language")
    @classmethod
    def _check_language(cls, value: str | None) -> str | None:
        return value.strip().lower() or None if value is not None else None


async def parse_form(
    body: bytes, content_type: str, form: type[TranslationForm]
) -> tuple[TranslationForm, bytes]:
    """The form's fields as ``form``, and the file's bytes; a 400 for a body
    that is not a multipart form with a ``file``, naming any bad field."""
    from starlette.datastructures import Headers, UploadFile
    from starlette.formparsers import MultiPartException, MultiPartParser

    if not content_type.lower().startswith("multipart/form-data"):
        raise APIError(
            400,
            "Send the audio as a multipart/form-data upload with a 'file' part, as "
            "OpenAI's SDK does.",
            param="file",
            code="invalid_request_error",
        )

    async def chunks() -> AsyncGenerator[bytes]:
        yield body

    headers = Headers(raw=[(b"content-type", content_type.encode("latin-1"))])
    try:
        parsed = await MultiPartParser(headers, chunks(), max_files=2).parse()
    except MultiPartException as exc:
        message = f"The multipart form cannot be read: {exc.message}"
        raise APIError(400, message, code="invalid_form") from None
    data: dict[str, Any] = {}
    upload = None
    for name, value in parsed.multi_items():
        if isinstance(value, UploadFile):
            if name != "file" or upload is not None:
                await parsed.close()
                raise _unknown(name, "only one file, as 'file'")
            upload = value
        elif name in _LISTS:
            data.setdefault(_LISTS[name], []).append(value)
        else:
            data[name] = value
    if upload is None:
        await parsed.close()
        raise APIError(
            400, "Missing required parameter: 'file'.", param="file", code="missing"
        )
    try:
        fields = form.model_validate(data)
        return fields, await upload.read()
    except ValidationError as exc:
        shown = json.dumps(data).encode()
        raise validation_error_to_api_error(exc, shown, field_names(form)) from None
    finally:
        await parsed.close()


def _unknown(name: str, taken: str) -> APIError:
    return APIError(
        400,
        f"Unrecognized file part supplied: {name}; the form takes {taken}.",
        param=name,
        code="unknown_parameter",
    )
