"""A request's prompt made into the model's inputs: the chat template and the
processor, or a raw prompt through the tokenizer alone. MLX thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from ..failures import AudioRefusedError, PromptError, VideoRefusedError
from .sampling import vlm

if TYPE_CHECKING:
    from PIL import Image

    from ..events import GenerationParams
    from .model import LoadedModel

__all__ = [
    "MEDIA_TOKENS",
    "Prepared",
    "build_prompt",
    "preprocess",
    "prompt_tokens",
    "raw_inputs",
]

# Families whose mlx-vlm embedding takes images or videos, not both at once.
_ONE_MEDIA_KIND = frozenset({"qwen2_vl", "qwen2_5_vl"})
# Families whose mlx-vlm embedding places a second audio file's features at
# the first one's padding (it drops the padded batch's mask): one audio
# file per prompt.
_ONE_AUDIO = frozenset({"gemma4"})
MEDIA_TOKENS = (
    "image_token_index",
    "image_token_id",
    "video_token_index",
    "video_token_id",
    "audio_token_id",
)


@dataclass(eq=False)
class Prepared:
    """A request's model inputs, before its prefill. ``scored``: the
    alternatives per token its prompt's log-probabilities list (None: none)."""

    inputs: dict[str, Any]
    prompt_tokens: int
    last: int  # the last prompt token
    scored: int | None = None


def preprocess(
    loaded: LoadedModel, params: GenerationParams, images: Sequence[Image.Image]
) -> Prepared:
    """The request's model inputs, cut to its ``truncate_prompt_tokens``.

    Raises:
        PromptError: An empty raw prompt, one with a media placeholder, or a
            prompt with media that would have to be cut.
        VideoRefusedError: The model takes no videos, or not beside images.
        AudioRefusedError: The model takes no audio, one file at a time and
            the request has more, or a file longer than the model hears.
    """
    keep = params.truncate_prompt_tokens
    if keep == -1:  # vLLM's: the model's context
        keep = params.context_length
    return truncated(_model_inputs(loaded, params, images), keep)


def truncated(prepared: Prepared, keep: int | None) -> Prepared:
    """The prompt's last ``keep`` tokens (None: all of them).

    Raises:
        PromptError: The prompt holds images, videos or audio.
    """
    if keep is None or prepared.prompt_tokens <= keep:
        return prepared
    inputs = prepared.inputs
    if set(inputs) - {"input_ids", "attention_mask"}:
        raise PromptError(
            f"The prompt has {prepared.prompt_tokens} tokens and images, videos "
            f"or audio, which truncate_prompt_tokens ({keep}) cannot cut: send "
            "a shorter prompt.",
            "invalid_prompt",
        )
    ids = inputs["input_ids"][:, -keep:]
    cut = {"input_ids": ids, "attention_mask": mx.ones_like(ids)}
    return Prepared(cut, keep, prepared.last, prepared.scored)


def _model_inputs(
    loaded: LoadedModel, params: GenerationParams, images: Sequence[Image.Image]
) -> Prepared:
    if params.prompt is not None:
        prepared = raw_inputs(loaded, params.prompt, params.add_special_tokens)
        config = loaded.model.config
        media = {getattr(config, name, None) for name in MEDIA_TOKENS}
        ids = prepared.inputs["input_ids"][0].tolist()
        held = [token for token in ids if isinstance(token, int) and token in media]
        if held:
            # A placeholder with no image behind it breaks some families' embedding.
            raise PromptError(
                f"The prompt holds the model's image placeholder token "
                f"{min(held)}: a raw prompt takes no images; leave it out.",
                "invalid_prompt",
            )
        return prepared
    api = vlm()
    model, processor = loaded.model, loaded.processor
    videos = _video_inputs(loaded, params, images)
    inputs = api.prepare_inputs(
        processor,
        images=list(images) or None,
        **videos,
        **_audio_inputs(loaded, params),
        prompts=build_prompt(
            loaded, params.messages, params.tools, params.template_kwargs
        ),
        image_token_index=getattr(model.config, "image_token_index", None),
        add_special_tokens=api.should_add_special_tokens(
            model.config.model_type, processor
        ),
    )
    ids = inputs["input_ids"]
    return Prepared(dict(inputs), int(ids.size), int(ids[0, -1].item()))


def accepts_videos(loaded: LoadedModel) -> bool:
    """Whether the model takes videos: a video processor and a video token."""
    config = loaded.model.config
    token = getattr(config, "video_token_id", None)
    token = token if token is not None else getattr(config, "video_token_index", None)
    processor = getattr(loaded.processor, "video_processor", None)
    return isinstance(token, int) and processor is not None


def _video_inputs(
    loaded: LoadedModel, params: GenerationParams, images: Sequence[Image.Image]
) -> dict[str, Any]:
    if not params.videos:
        return {}
    if not accepts_videos(loaded):
        raise VideoRefusedError(
            f"this model ({loaded.config.model_type}) takes no videos; send "
            "images or text.",
            index=0,
            code="videos_unsupported",
        )
    if images and loaded.config.model_type in _ONE_MEDIA_KIND:
        raise VideoRefusedError(
            f"this model ({loaded.config.model_type}) takes images or videos in "
            "one request, not both; send them in separate requests.",
            index=0,
            code="mixed_media_unsupported",
        )
    return {
        "videos": [video.frames for video in params.videos],
        "video_metadata": [video.metadata() for video in params.videos],
    }


def _audio_inputs(loaded: LoadedModel, params: GenerationParams) -> dict[str, Any]:
    if not params.audios:
        return {}
    taken = loaded.audio_input
    if taken is None:
        raise AudioRefusedError(
            f"this model ({loaded.config.model_type}) takes no audio; send it to "
            "a model that does.",
            index=0,
            code="audio_unsupported",
        )
    several = getattr(loaded.processor, "supports_multiple_audio", False)
    if len(params.audios) > 1 and (
        # mlx-vlm would keep the first file alone and leave the others'
        # placeholders empty, or misplace them (see _ONE_AUDIO).
        not several or loaded.config.model_type in _ONE_AUDIO
    ):
        raise AudioRefusedError(
            f"this model ({loaded.config.model_type}) takes one audio file per "
            "request; send the others in separate requests.",
            index=1,
            code="too_many_audios",
        )
    longest = taken.max_seconds
    for index, audio in enumerate(params.audios):
        if longest is not None and audio.seconds > longest:
            # The HTTP side refuses it from its header first; this guards
            # other callers, as the processor caps a file's placeholders
            # there and the features past them would be dropped unheard.
            raise AudioRefusedError(
                f"the file is {audio.seconds:.1f} seconds long; this model "
                f"({loaded.config.model_type}) hears at most {longest:g} seconds "
                "of audio per file.",
                index=index,
                code="audio_too_long",
            )
    return {"audio": [audio.samples for audio in params.audios]}


def raw_inputs(
    loaded: LoadedModel, prompt: str | Sequence[int], add_special_tokens: bool = True
) -> Prepared:
    """A raw prompt's model inputs: text through the tokenizer alone (no chat
    template), token ids as they are; the inputs the processor makes of a
    text prompt, so the ids a chat renders to are prefilled as that chat.

    Raises:
        PromptError: The prompt has no tokens.
    """
    if isinstance(prompt, str):
        tokenizer = loaded.tokenizer
        ids = list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    else:
        ids = list(prompt)
    if not ids:
        raise PromptError("The prompt has no tokens: send some text.", "empty_prompt")
    tokens = mx.array([ids], dtype=mx.int32)
    inputs = {"input_ids": tokens, "attention_mask": mx.ones_like(tokens)}
    return Prepared(inputs, len(ids), ids[-1])


def prompt_tokens(
    loaded: LoadedModel, params: GenerationParams
) -> tuple[tuple[int, str], ...]:
    """The tokens a generation of ``params`` (no images) would prefill, each
    with its text."""
    if params.prompt is not None:
        prepared = raw_inputs(loaded, params.prompt, params.add_special_tokens)
    else:
        prepared = preprocess(loaded, params, ())
    ids = prepared.inputs["input_ids"][0].tolist()
    return tuple((int(token), loaded.token_text(int(token))[0]) for token in ids)


def build_prompt(
    loaded: LoadedModel,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] = (),
    template_kwargs: Sequence[tuple[str, Any]] = (),
) -> str:
    """The prompt text from the model's chat template; ``tools`` and
    ``template_kwargs`` (``chat_template_kwargs``) reach it as keywords.

    A chat with videos or audio goes to the template with its media markers
    in place: mlx-vlm's formatting would move videos ahead of the text, and
    Gemma 4's processor every audio file to the end of its turn.
    """
    from mlx_vlm.prompt_utils import apply_chat_template, get_chat_template

    num_images = sum(
        1
        for m in messages
        if isinstance(m["content"], list)
        for part in m["content"]
        if part["type"] == "image_url"
    )
    extra: dict[str, Any] = dict(template_kwargs)
    opened = bool(extra.pop("add_generation_prompt", True))
    if tools:
        extra["tools"] = list(tools)
    kinds = {
        part["type"]
        for m in messages
        if isinstance(m["content"], list)
        for part in m["content"]
    }
    if "audio" in kinds:
        marked = [_marked(m) for m in messages]
        rendered = loaded.tokenizer.apply_chat_template(
            marked,
            chat_template=loaded.chat_template,
            tokenize=False,
            add_generation_prompt=opened,
            **extra,
        )
        return str(rendered)
    if "video" in kinds:
        marked = [_marked(m) for m in messages]
        return str(get_chat_template(loaded.processor, marked, opened, **extra))
    prompt = apply_chat_template(
        loaded.processor,
        loaded.config,
        list(messages),
        add_generation_prompt=opened,
        num_images=num_images,
        **extra,
    )
    return str(prompt)


def _marked(message: dict[str, Any]) -> dict[str, Any]:
    """A message as Qwen-VL chat templates read media: ``{"type": "image"}``."""
    content = message["content"]
    if not isinstance(content, list):
        return message
    parts = [
        {"type": "image"} if part["type"] == "image_url" else part for part in content
    ]
    return {**message, "content": parts}
