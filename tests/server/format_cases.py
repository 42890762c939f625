"""Answers written in each output format's real syntax, and what they
parse to: the cases the format tests share (the parsers' own tests, and
every door's streaming). Plain data, no test here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mlx_pinned.server.formats import ToolSpec

WEATHER = ToolSpec(
    "get_weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "options": {"type": "object"},
        },
        "required": ["city"],
    },
)
CLOCK = ToolSpec(
    "get_time",
    {
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"],
    },
)
TOOLS = [WEATHER, CLOCK]
# What forced calls are checked against: types every format can force.
FORCED = ToolSpec(
    "get_weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
    },
)
OPTIONS = {"units": {"temp": "C"}, "hours": [1, 2]}
BAR, MARK = "\uff5c", "\u2581"


def deepseek(*words: str) -> str:
    return f"<{BAR}{MARK.join(words)}{BAR}>"


DS_OPEN, DS_CLOSE = deepseek("tool", "calls", "begin"), deepseek("tool", "calls", "end")
DS_CALL, DS_END = deepseek("tool", "call", "begin"), deepseek("tool", "call", "end")
DS_SEP = deepseek("tool", "sep")


@dataclass(frozen=True)
class Case:
    """An answer in one format, and what it must parse to."""

    format: str
    text: str
    content: str
    calls: list[tuple[str, dict[str, Any]]]
    markup: tuple[str, ...]  # what must never reach the content
    tools: list[ToolSpec] = field(default_factory=lambda: TOOLS)


CASES = [
    Case(
        "qwen3_coder",
        "Let me check — 天気.\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nSão Paulo <tool_call> <function=x>\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=options>\n"
        f"{json.dumps(OPTIONS)}\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n"
        "</function>\n</tool_call>\nDone ✓",
        "Let me check — 天気.Done ✓",
        [
            (
                "get_weather",
                {
                    "city": "São Paulo <tool_call> <function=x>",
                    "days": 3,
                    "options": OPTIONS,
                },
            ),
            ("get_time", {"zone": "UTC"}),
        ],
        ("<tool_call>", "</tool_call>", "<function=", "<parameter="),
    ),
    Case(
        "mistral",
        'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": '
        '{"city": "Zürich [TOOL_CALLS] x[ARGS]{}", "days": 3, "options": '
        f'{json.dumps(OPTIONS)}}}}}, {{"name": "get_time", "arguments": '
        '{"zone": "UTC"}}] Anything else?',
        "Checking.Anything else?",
        [
            (
                "get_weather",
                {
                    "city": "Zürich [TOOL_CALLS] x[ARGS]{}",
                    "days": 3,
                    "options": OPTIONS,
                },
            ),
            ("get_time", {"zone": "UTC"}),
        ],
        ("[TOOL_CALLS]", "[ARGS]"),
    ),
    Case(
        "mistral_v11",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich [ARGS] é", '
        f'"days": 3, "options": {json.dumps(OPTIONS)}}}'
        '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}',
        "Sure.",
        [
            ("get_weather", {"city": "Zürich [ARGS] é", "days": 3, "options": OPTIONS}),
            ("get_time", {"zone": "UTC"}),
        ],
        ("[TOOL_CALLS]", "[ARGS]"),
    ),
    Case(
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "München; {\\"name\\": 1}", '
        f'"days": 3, "options": {json.dumps(OPTIONS)}}}}}; '
        '{"name": "get_time", "parameters": {"zone": "UTC"}} Done ✓',
        "Done ✓",
        [
            (
                "get_weather",
                {"city": 'München; {"name": 1}', "days": 3, "options": OPTIONS},
            ),
            ("get_time", {"zone": "UTC"}),
        ],
        ('"parameters"', "<|python_tag|>"),
    ),
    Case(
        "llama3_json",
        'I will look it up. <|python_tag|>{"name": "get_time", "parameters": '
        '{"zone": "CET"}}',
        "I will look it up.",
        [("get_time", {"zone": "CET"})],
        ('"parameters"', "<|python_tag|>"),
    ),
    Case(
        "pythonic",
        'Checking.<|tool_call_start|>[get_weather(city="Paris <|tool_call_start|>)",'
        ' days=3, options={"units": {"temp": "C"}, "hours": [1, 2]}), '
        'get_time(zone="UTC")]<|tool_call_end|>Done ✓',
        "Checking.Done ✓",
        [
            (
                "get_weather",
                {"city": "Paris <|tool_call_start|>)", "days": 3, "options": OPTIONS},
            ),
            ("get_time", {"zone": "UTC"}),
        ],
        ("<|tool_call_start|>", "<|tool_call_end|>", "get_weather("),
    ),
    Case(
        "glm47",
        "Let me see.<tool_call>get_weather<arg_key>city</arg_key>"
        "<arg_value>Köln <arg_key></arg_value><arg_key>days</arg_key>"
        f"<arg_value>3</arg_value><arg_key>options</arg_key><arg_value>"
        f"{json.dumps(OPTIONS)}</arg_value></tool_call><tool_call>get_time"
        "<arg_key>zone</arg_key><arg_value>UTC</arg_value></tool_call>",
        "Let me see.",
        [
            ("get_weather", {"city": "Köln <arg_key>", "days": 3, "options": OPTIONS}),
            ("get_time", {"zone": "UTC"}),
        ],
        ("<tool_call>", "<arg_key>", "<arg_value>"),
    ),
    Case(  # GLM-4.5 and 4.6 put newlines between the parts
        "glm47",
        "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>CET</arg_value>\n"
        "</tool_call>\nOK.",
        "OK.",
        [("get_time", {"zone": "CET"})],
        ("<tool_call>", "<arg_key>", "<arg_value>"),
    ),
    Case(
        "kimi_k2",
        "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "東京 <|tool_calls_section_begin|>", '
        f'"days": 3, "options": {json.dumps(OPTIONS)}}}<|tool_call_end|>'
        "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>"
        '{"zone": "UTC"}<|tool_call_end|><|tool_calls_section_end|>',
        "Sure.",
        [
            (
                "get_weather",
                {
                    "city": "東京 <|tool_calls_section_begin|>",
                    "days": 3,
                    "options": OPTIONS,
                },
            ),
            ("get_time", {"zone": "UTC"}),
        ],
        ("<|tool_call", "functions."),
    ),
    Case(
        "deepseek_v3",
        f"Checking.{DS_OPEN}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
        f'{{"city": "Paris ```", "days": 3, "options": {json.dumps(OPTIONS)}}}\n'
        f"```{DS_END}{DS_CALL}function{DS_SEP}get_time\n```json\n"
        f'{{"zone": "UTC"}}\n```{DS_END}{DS_CLOSE}',
        "Checking.",
        [
            ("get_weather", {"city": "Paris ```", "days": 3, "options": OPTIONS}),
            ("get_time", {"zone": "UTC"}),
        ],
        (BAR, "```"),
    ),
    Case(
        "deepseek_v31",
        f'{DS_OPEN}{DS_CALL}get_weather{DS_SEP}{{"city": "Paris {DS_SEP}", '
        f'"options": {json.dumps(OPTIONS)}}}{DS_END}{DS_CLOSE} Voilà.',
        "Voilà.",
        [("get_weather", {"city": f"Paris {DS_SEP}", "options": OPTIONS})],
        (BAR,),
    ),
    Case(
        "gemma4",
        'Checking.<|tool_call>call:get_weather{city:<|"|>Paris, {France}: '
        '<|tool_call><|"|>,'
        'days:3,options:{units:{temp:<|"|>C<|"|>},hours:[1,2]}}<tool_call|>'
        '<|tool_call>call:get_time{zone:<|"|>UTC<|"|>}<tool_call|>Done ✓',
        "Checking.Done ✓",
        [
            (
                "get_weather",
                {
                    "city": "Paris, {France}: <|tool_call>",
                    "days": 3,
                    "options": OPTIONS,
                },
            ),
            ("get_time", {"zone": "UTC"}),
        ],
        ("<|tool_call>", "<tool_call|>", '<|"|>', "call:"),
    ),
    Case(
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        f'{{"city": "Rome </tool_call", "options": {json.dumps(OPTIONS)}}}}}\n'
        "</tool_call>",
        "Let me check.",
        [("get_weather", {"city": "Rome </tool_call", "options": OPTIONS})],
        ("<tool_call>",),
    ),
]


# A call to FORCED as each format's grammar writes it.
FORCED_TEXT = {
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "glm47": "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
    "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
    "mistral_v11": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": '
    '{"city": "Paris", "days": 3}}]',
    "llama3_json": '{"name": "get_weather", "parameters": '
    '{"city": "Paris", "days": 3}}',
    "pythonic": '<|tool_call_start|>[get_weather(city="Paris", days=3)]'
    "<|tool_call_end|>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
    "<|tool_calls_section_end|>",
    "deepseek_v3": f"{DS_OPEN}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
    f'{{"city": "Paris", "days": 3}}\n```{DS_END}{DS_CLOSE}',
    "deepseek_v31": f'{DS_OPEN}{DS_CALL}get_weather{DS_SEP}{{"city": "Paris", '
    f'"days": 3}}{DS_END}{DS_CLOSE}',
    "gemma4": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
    "harmony": "<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "days": 3}',
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": 3}}\n</tool_call>',
}


# A tool taking lists, objects, null and any value: what the formats that
# write their own literals (pythonic, Gemma 4) force, and texts their
# grammars accept (True) or refuse (False: over maxItems, a missing key).
PLAN = ToolSpec(
    "plan",
    {
        "type": "object",
        "properties": {
            "steps": {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "minItems": 1,
                "maxItems": 3,
            },
            "opts": {
                "type": "object",
                "properties": {
                    "deep": {"type": "boolean"},
                    "n": {"type": "integer"},
                    "z": {"type": "null"},
                },
                "required": ["deep", "n", "z"],
            },
            "any": {},
            "free": {"type": "object"},
            "pick": {"anyOf": [{"type": "integer"}, {"enum": ["a", "b"]}]},
        },
        "required": ["steps", "opts", "any", "free", "pick"],
    },
)
PLAN_ARGUMENTS = {
    "steps": ["a", "bc"],
    "opts": {"deep": True, "n": 3, "z": None},
    "any": [1, {"k": "v"}],
    "free": {"x": [True, None]},
    "pick": "b",
}
PLAN_TEXT = {
    "pythonic": [
        (
            '<|tool_call_start|>[plan(steps=["a", "bc"], opts={"deep": True, '
            '"n": 3, "z": None}, any=[1, {"k": "v"}], free={"x": [True, None]}, '
            'pick="b")]<|tool_call_end|>',
            True,
        ),
        (
            '<|tool_call_start|>[plan(steps=["a", "b", "c", "d"], opts={"deep": '
            'True, "n": 3, "z": None}, any=1, free={}, pick=2)]<|tool_call_end|>',
            False,
        ),
    ],
    "gemma4": [
        (
            '<|tool_call>call:plan{steps:[<|"|>a<|"|>,<|"|>bc<|"|>],opts:{deep:true,'
            'n:3,z:null},any:[1,{k:<|"|>v<|"|>}],free:{x:[true,null]},'
            'pick:<|"|>b<|"|>}<tool_call|>',
            True,
        ),
        (
            '<|tool_call>call:plan{steps:[<|"|>a<|"|>],opts:{deep:true,n:3},'
            "any:1,free:{},pick:2}<tool_call|>",
            False,
        ),
    ],
}
