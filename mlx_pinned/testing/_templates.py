"""Pieces of the tiny families' Jinja chat templates. Calling thread; plain
strings, nothing rendered here.
"""

from __future__ import annotations


def template(*pieces: str) -> str:
    """A chat template made of ``pieces``, in order."""
    return "".join(pieces)


def content(image: str, *, strings: bool = False, trim: bool = False) -> str:
    """Jinja writing ``message['content']``: a string as it is, or its parts
    as :func:`parts` writes them (``None`` writes nothing)."""
    pipe = " | trim" if trim else ""
    return template(
        "{%- if message['content'] is string -%}",
        "{{- message['content']" + pipe + " -}}",
        "{%- elif message['content'] is not none -%}",
        parts("message['content']", image, strings=strings, trim=trim),
        "{%- endif -%}",
    )


def parts(source: str, image: str, *, strings: bool = False, trim: bool = False) -> str:
    """Jinja writing each typed part of the list ``source`` (an expression).

    Args:
        source: The list of parts.
        image: What an image part becomes: the inside of a Jinja string
            literal, escapes included.
        strings: Write bare strings among the parts too.
        trim: Trim every text of white space.
    """
    pipe = " | trim" if trim else ""
    bare = "{%- if part is string -%}{{- part" + pipe + " -}}{%- elif "
    return template(
        "{%- for part in " + source + " -%}",
        bare if strings else "{%- if ",
        "part.get('type', '') in ('image', 'image_url') -%}",
        "{{- '" + image + "' -}}",
        "{%- elif 'text' in part -%}",
        "{{- part['text']" + pipe + " -}}",
        "{%- endif -%}",
        "{%- endfor -%}",
    )


def generation_prompt(text: str) -> str:
    """Jinja opening the assistant's turn with ``text`` (the inside of a
    Jinja string literal) when ``add_generation_prompt`` is true."""
    return "{%- if add_generation_prompt -%}{{- '" + text + "' -}}{%- endif -%}"
