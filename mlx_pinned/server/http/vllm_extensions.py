"""What vLLM adds to both OpenAI doors (chat and legacy completions) beyond
sampling: its spellings of a constrained answer (``structured_outputs`` and
the older ``guided_*``), ``stop_reason`` and ``prompt_logprobs``' shape.

Pure CPU, any thread. Each constraint maps onto the one
:class:`~..events.Grammar` that ``response_format`` maps onto; at most one
may be set, and a ``grammar`` is an llguidance Lark grammar (vLLM's guidance
backend's syntax).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from ..events import Grammar, PromptLogprob
from .errors import APIError
from .protocol_common import RequestBody, unsupported

__all__ = [
    "PromptTokenLogprob",
    "StopReason",
    "StopReasonChoice",
    "StructuredOutputFields",
    "StructuredOutputs",
    "VLLMPromptLogprobs",
    "conflict",
    "vllm_prompt_logprobs",
]

Choices = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
JSONSchema = dict[str, Any] | str


class StructuredOutputs(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    json_: JSONSchema | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: Annotated[str, Field(min_length=1)] | None = None
    choice: Choices | None = None
    grammar: Annotated[str, Field(min_length=1)] | None = None
    # vLLM's switches for its own backends: whitespace is never allowed
    # between JSON tokens here, so only the value that says so is taken.
    disable_any_whitespace: bool | None = None
    structural_tag: Any = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        if self.structural_tag is not None:
            raise unsupported(
                "structured_outputs.structural_tag",
                "this server has no structural tags; use 'tools' or 'grammar'",
            )
        if self.disable_any_whitespace is False:
            raise unsupported(
                "structured_outputs.disable_any_whitespace",
                "this server's JSON grammars allow no whitespace between tokens",
            )
        set_ = [name for name, value in self._constraints().items() if value]
        if len(set_) > 1:
            raise ValueError(f"set one of {', '.join(set_)}, not several")
        if not set_:
            raise ValueError("set one of json, json_object, regex, choice, grammar")
        return self

    def _constraints(self) -> dict[str, Any]:
        return {
            "json": self.json_ is not None,
            "json_object": bool(self.json_object),
            "regex": self.regex is not None,
            "choice": self.choice is not None,
            "grammar": self.grammar is not None,
        }

    def to_grammar(self) -> Grammar:
        if self.json_ is not None:
            return json_grammar(self.json_)
        if self.regex is not None:
            return Grammar("regex", self.regex)
        if self.choice is not None:
            return choice_grammar(self.choice)
        if self.grammar is not None:
            return Grammar("lark", self.grammar)
        return Grammar("json_object")


def json_grammar(schema: JSONSchema) -> Grammar:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return Grammar("json_schema", text)


def choice_grammar(choices: list[str]) -> Grammar:
    """Exactly one of ``choices``: a Lark grammar of their literals."""
    return Grammar("lark", "start: " + " | ".join(json.dumps(c) for c in choices))


class StructuredOutputFields(RequestBody):
    structured_outputs: StructuredOutputs | None = None
    guided_json: JSONSchema | None = None
    guided_regex: Annotated[str, Field(min_length=1)] | None = None
    guided_choice: Choices | None = None
    guided_grammar: Annotated[str, Field(min_length=1)] | None = None

    def _spellings(self) -> list[tuple[str, Grammar]]:
        spellings: list[tuple[str, Grammar]] = []
        if self.structured_outputs is not None:
            spellings.append(
                ("structured_outputs", self.structured_outputs.to_grammar())
            )
        if self.guided_json is not None:
            spellings.append(("guided_json", json_grammar(self.guided_json)))
        if self.guided_regex is not None:
            spellings.append(("guided_regex", Grammar("regex", self.guided_regex)))
        if self.guided_choice is not None:
            spellings.append(("guided_choice", choice_grammar(self.guided_choice)))
        if self.guided_grammar is not None:
            spellings.append(("guided_grammar", Grammar("lark", self.guided_grammar)))
        return spellings

    def structured_grammar(self) -> tuple[str, Grammar] | None:
        """The field that constrains the answer and its grammar (None: none);
        a 400 naming the second of two fields set."""
        spellings = self._spellings()
        if len(spellings) > 1:
            first, second = spellings[0][0], spellings[1][0]
            raise conflict(second, first)
        return spellings[0] if spellings else None


def conflict(param: str, other: str) -> APIError:
    return APIError(
        400,
        f"Invalid value for '{param}': '{other}' constrains the answer already; "
        "send one of them.",
        param=param,
        code="invalid_value",
    )


#: vLLM's ``stop_reason``: the stop token's id or the stop string that
#: ended a choice; null when it ended otherwise.
StopReason = int | str | None


class StopReasonChoice(BaseModel):
    """A choice that has vLLM's ``stop_reason`` (its subclass declares the
    field after ``finish_reason``): written where ``finish_reason`` is set,
    left out of a stream chunk that has none."""

    @model_serializer(mode="wrap")
    def _stop_reason_with_finish(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if data.get("finish_reason") is None:
            data.pop("stop_reason", None)
        return data


class PromptTokenLogprob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    logprob: float
    rank: int
    decoded_token: str


#: vLLM's ``prompt_logprobs``: per prompt token, null for the first.
VLLMPromptLogprobs = list[dict[str, PromptTokenLogprob] | None]


def vllm_prompt_logprobs(
    entries: Sequence[PromptLogprob], top: int
) -> VLLMPromptLogprobs:
    """``entries`` in vLLM's shape, with ``top`` alternatives each and the
    prompt's own token."""
    out: VLLMPromptLogprobs = []
    for entry in entries:
        if entry.logprob is None or entry.rank is None:
            out.append(None)
            continue
        tokens: dict[str, PromptTokenLogprob] = {}
        for rank, (token_id, text, value) in enumerate(entry.top[:top], start=1):
            tokens[str(token_id)] = PromptTokenLogprob(
                logprob=value, rank=rank, decoded_token=text
            )
        tokens.setdefault(
            str(entry.token_id),
            PromptTokenLogprob(
                logprob=entry.logprob, rank=entry.rank, decoded_token=entry.token
            ),
        )
        out.append(tokens)
    return out
