"""Prompts into KV caches for the decode batch: one alone, or several at once.

MLX thread only. :func:`preprocess` turns a request into model inputs (chat
template, processor; or a raw prompt, tokenized without the template).
:func:`prefill_together` runs the prompts of several requests in one pass:
their images through the vision tower together, their tokens left-padded
into one ``BatchKVCache``; :class:`ChunkedPrefill` runs one with mlx-vlm's
single-stream operations. Both run every prompt token but the last; the
last (a text token) runs in the next decode step, which samples the first
token: the same operation as mlx-vlm's last prefill pass (its embedding, at
position offset + rope delta). Padded positions are masked and add exact
zeros, so a prompt's cache is the same alone or together (the tests compare
the log-probabilities with the unbatched path). With ``kv_bits`` set both
write quantized caches (:mod:`.kv_quant`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import mlx.core as mx

from ..failures import AudioRefusedError, PromptError, VideoRefusedError
from .kv_quant import KVQuant, batch_layer, kv_length, single_caches, to_batch
from .model import LoadedModel
from .quirks import rope_deltas, row_rope_deltas
from .sampling import vlm

if TYPE_CHECKING:
    from PIL import Image

    from ..events import GenerationParams

# mlx-vlm's default chunk: longer prompts are prefilled alone, in chunks.
PREFILL_STEP = 2048
# Processor outputs a prompt may have and still be prefilled with others.
_BATCHABLE_INPUTS = frozenset({"input_ids", "attention_mask", "pixel_values"})
_BATCHABLE_INPUTS |= {"image_grid_thw"}
# Prefill inputs that matter only for media and rope positions, which a
# decode step of a text token recomputes the same way.
_POSITION_ONLY = frozenset(
    {
        "image_grid_thw",
        "video_grid_thw",
        "position_ids",
        "rope_deltas",
        "visual_pos_masks",
        "deepstack_visual_embeds",
    }
)
# Families whose mlx-vlm embedding places every row's image features at the
# first row's image positions (it assumes one row): their prompts with
# images are prefilled alone.
_ONE_ROW_IMAGES = frozenset({"aya_vision"})
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
    """A request's model inputs, before its prefill.

    Attributes:
        scored: Alternatives per prompt token its prompt's log-probabilities
            list (vLLM's ``prompt_logprobs``); None: they are not computed.
    """

    inputs: dict[str, Any]
    prompt_tokens: int
    last: int  # the last prompt token
    scored: int | None = None


class PromptScores(NamedTuple):
    """The log-probabilities of a prompt's tokens from the second on, each
    under the model's distribution after the tokens before it (raw: no
    penalty, bias or temperature), as plain values.

    Attributes:
        tokens: The prompt's tokens, the first included.
        logprobs: Each one's log-probability but the first's.
        ranks: Each one's rank in its distribution (1: the most likely).
        top: Each position's most likely tokens, likeliest first.
    """

    tokens: list[int]
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]


class _Scoring:
    """A prompt's scores as its prefill passes compute them, lazily: each
    pass's logits (T, V) for the prompt's tokens after its positions."""

    def __init__(self, ids: mx.array, top: int) -> None:
        self.ids = ids.reshape(-1)
        self.top = top
        self.parts: list[tuple[mx.array, ...]] = []

    def add(self, logits: mx.array, start: int) -> None:
        """The logits of positions ``start`` onwards (one pass's)."""
        targets = self.ids[start + 1 : start + 1 + logits.shape[0]]
        logits = logits[: targets.shape[0]].astype(mx.float32)
        # Media placeholders past the vocabulary (some families') are read
        # as its last token rather than outside the array.
        targets = mx.minimum(targets, logits.shape[-1] - 1)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
        ranks = mx.sum(logprobs > chosen[:, None], axis=-1) + 1
        part: tuple[mx.array, ...] = (targets, chosen, ranks)
        if self.top:
            keep = min(self.top, logprobs.shape[-1])
            ids = mx.argpartition(-logprobs, kth=keep - 1, axis=-1)[:, :keep]
            part += (ids, mx.take_along_axis(logprobs, ids, axis=-1))
        mx.async_eval(part)  # type: ignore[no-untyped-call]
        self.parts.append(part)

    def scores(self) -> PromptScores:
        """Every pass's scores, read, in prompt order."""
        out = PromptScores([cast("int", self.ids[0].item())], [], [], [])
        for part in self.parts:
            out.tokens.extend(cast("list[int]", part[0].tolist()))
            out.logprobs.extend(cast("list[float]", part[1].tolist()))
            out.ranks.extend(cast("list[int]", part[2].tolist()))
            if len(part) == 3:
                out.top.extend([] for _ in range(part[0].shape[0]))
                continue
            ids = cast("list[list[int]]", part[3].tolist())
            values = cast("list[list[float]]", part[4].tolist())
            for row_ids, row_values in zip(ids, values, strict=True):
                pairs = sorted(
                    zip(row_ids, row_values, strict=True), key=lambda p: -p[1]
                )
                out.top.append(pairs)
        return out


@dataclass(eq=False)
class Prefilled:
    """Prompts in a batch cache, ready to join the decode batch.

    Attributes:
        cache: One batch cache per layer, a row per prompt.
        deltas: Their rope deltas (B, 1), for Qwen-VL style models.
        logits: (B, V) of the last prompt tokens, to sample the first tokens
            from; None when the last tokens are left for the decode step
            (see :class:`ChunkedPrefill`).
        scores: Each prompt's scores, for those whose ``scored`` is set.
    """

    cache: list[Any]
    deltas: mx.array | None
    logits: mx.array | None = None
    scores: list[PromptScores | None] = field(default_factory=list)


def preprocess(
    loaded: LoadedModel, params: GenerationParams, images: Sequence[Image.Image]
) -> Prepared:
    """Chat template and processor: token ids, pixels and their metadata; a
    raw ``params.prompt`` skips both (see :func:`raw_inputs`); then cut to
    the request's ``truncate_prompt_tokens``.

    Raises:
        PromptError: A prompt with media that would have to be cut.
    """
    keep = params.truncate_prompt_tokens
    if keep == -1:  # vLLM's: the model's context
        keep = params.context_length
    return truncated(_model_inputs(loaded, params, images), keep)


def truncated(prepared: Prepared, keep: int | None) -> Prepared:
    """The prompt's last ``keep`` tokens (vLLM's ``truncate_prompt_tokens``:
    a left cut); the prompt as it is when it is no longer, or ``keep`` is
    None.

    Raises:
        PromptError: The prompt holds images, videos or audio (their tokens
            and their features cannot be cut apart).
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
            # A placeholder with no image behind it: not every family's
            # embedding survives one.
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
    """The processor's video arguments (none without videos).

    Raises:
        VideoRefusedError: The model takes no videos, or (Qwen2-VL and
            Qwen2.5-VL, whose mlx-vlm embedding takes one kind of media per
            prompt) images and videos together.
    """
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
    """The processor's audio argument: each file's samples, at the model's
    rate (none without audio).

    Raises:
        AudioRefusedError: The model takes no audio, one file at a time and
            the request has more, or a file longer than the model hears.
    """
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
    template), token ids as they are; the same ``input_ids`` and
    ``attention_mask`` the processor makes of a text prompt, so a prompt
    sent as the ids a chat renders to is prefilled exactly as that chat.

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
    with its text (:meth:`.model.LoadedModel.token_text`)."""
    if params.prompt is not None:
        prepared = raw_inputs(loaded, params.prompt, params.add_special_tokens)
    else:
        prepared = preprocess(loaded, params, ())
    ids = prepared.inputs["input_ids"][0].tolist()
    return tuple((int(token), loaded.token_text(int(token))[0]) for token in ids)


def batchable(
    loaded: LoadedModel, prepared: Prepared, step: int = PREFILL_STEP
) -> bool:
    """Whether a prompt may be prefilled with others: one chunk of ``step``
    tokens, known inputs, and a last token that a decode step can run."""
    return (
        prepared.prompt_tokens <= step
        and set(prepared.inputs) <= _BATCHABLE_INPUTS
        and _text_last(loaded, prepared)
        and batch_caches(loaded.model.language_model, [0]) is not None
        and not (
            "pixel_values" in prepared.inputs
            and loaded.config.model_type in _ONE_ROW_IMAGES
        )
    )


def _text_last(loaded: LoadedModel, prepared: Prepared) -> bool:
    config = loaded.model.config
    media = {getattr(config, name, None) for name in MEDIA_TOKENS}
    return prepared.prompt_tokens > 1 and prepared.last not in media


def prefill_together(
    loaded: LoadedModel, prompts: Sequence[Prepared], quant: KVQuant | None = None
) -> Prefilled:
    """Prefill :func:`batchable` prompts in one pass; ``logits`` holds each
    one's next-token logits (left padding puts every last token in the last
    column), so the first token is sampled without another forward pass.
    ``quant``: the KV cache is quantized so."""
    model, lm = loaded.model, loaded.model.language_model
    lengths = [p.prompt_tokens for p in prompts]
    width = max(lengths)
    pads = [width - n for n in lengths]
    ids = mx.concatenate(
        [
            mx.pad(p.inputs["input_ids"], [(0, 0), (pad, 0)])
            for p, pad in zip(prompts, pads, strict=True)
        ]
    )
    mask = mx.array([[0] * pad + [1] * n for pad, n in zip(pads, lengths, strict=True)])
    pixels = [p.inputs["pixel_values"] for p in prompts if "pixel_values" in p.inputs]
    grids = [
        p.inputs["image_grid_thw"] for p in prompts if "image_grid_thw" in p.inputs
    ]
    extra = {"image_grid_thw": mx.concatenate(grids)} if grids else {}
    embedded = model.get_input_embeddings(
        ids, mx.concatenate(pixels) if pixels else None, mask=mask, **extra
    )
    kwargs = _prefill_kwargs(extra, embedded)
    cache = batch_caches(lm, pads, quant)
    assert cache is not None, "batchable() keeps this model's prompts apart"
    scored = any(p.scored is not None for p in prompts)
    output = lm(
        inputs=ids,
        inputs_embeds=embedded.inputs_embeds,
        cache=cache,
        n_to_process=width,
        logits_to_keep=width if scored else 1,
        **kwargs,
    )
    logits = output.logits[:, -1, :]
    scorings: list[_Scoring | None] = []
    for row, (prompt, pad) in enumerate(zip(prompts, pads, strict=True)):
        scoring = None
        if prompt.scored is not None:
            # Left padding: the row's positions are its last columns.
            scoring = _Scoring(prompt.inputs["input_ids"], prompt.scored)
            scoring.add(output.logits[row, pad:], 0)
        scorings.append(scoring)
    deltas = row_rope_deltas(lm, kwargs, pads, media=bool(pixels))
    mx.eval([c.state for c in cache], deltas, logits)
    scores = [None if s is None else s.scores() for s in scorings]
    return Prefilled(cache, deltas, logits, scores)


class ChunkedPrefill:
    """One prompt's prefill with mlx-vlm's single-stream operations, a chunk
    of ``step`` tokens per :meth:`advance`, so decode steps of the batch can
    run between the chunks of a long prompt.

    When the prompt is :func:`batchable`'s kind its last token is left for the
    decode step; otherwise it runs too and ``logits`` holds its output.
    ``prefix``: per layer, the keys and values of the prompt's first tokens
    (from the prompt cache); only the tokens after them are run. The model
    sees the whole prompt's positions and media, cut at the cache's offset,
    as in any chunked prefill. Made (images through the vision tower
    included) at once; MLX thread only. ``quant``: the KV cache is
    quantized so (a quantized ``prefix`` is taken as it is).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        prepared: Prepared,
        prefix: Sequence[tuple[mx.array, mx.array]] = (),
        step: int = PREFILL_STEP,
        quant: KVQuant | None = None,
    ) -> None:
        model = loaded.model
        self.loaded, self.prepared, self.step = loaded, prepared, step
        self.lm = model.language_model
        inputs = prepared.inputs
        ids = inputs["input_ids"]
        extra = {
            k: val
            for k, val in inputs.items()
            if k not in ("input_ids", "pixel_values", "attention_mask")
        }
        embedded = model.get_input_embeddings(
            ids, inputs.get("pixel_values"), mask=inputs.get("attention_mask"), **extra
        )
        self.kwargs = _prefill_kwargs(extra, embedded)
        self.embeds, self.ids = embedded.inputs_embeds, ids
        self.cache = single_caches(self.lm, quant)
        self._ran = 0  # prompt tokens run so far
        self._scoring = None
        if prepared.scored is not None:
            assert not prefix, "a scored prompt is prefilled whole"
            self._scoring = _Scoring(ids, prepared.scored)
        if prefix:
            reused = kv_length(prefix[0][0])
            for layer, (keys, values) in zip(self.cache, prefix, strict=True):
                layer.keys, layer.values, layer.offset = keys, values, reused
            self.embeds, self.ids = self.embeds[:, reused:], self.ids[:, reused:]

    @property
    def left(self) -> int:
        """Prompt tokens not yet run."""
        return int(self.embeds.shape[1])

    def advance(self, tokens: int | None = None) -> Prefilled | None:
        """Run the next chunk, of ``tokens`` tokens at most (``step`` by
        default); the prompt in a batch cache once it is done."""
        embeds, ids, lm, kwargs = self.embeds, self.ids, self.lm, self.kwargs
        if embeds.shape[1] > 1:
            n = min(tokens or self.step, embeds.shape[1] - 1)
            scoring = self._scoring
            output = lm(
                inputs=ids[:, :n],
                inputs_embeds=embeds[:, :n],
                cache=self.cache,
                n_to_process=n,
                logits_to_keep=1 if scoring is None else n,
                **kwargs,
            )
            if scoring is not None:
                scoring.add(output.logits[0, -n:], self._ran)
            mx.eval([c.state for c in self.cache])
            self._ran += n
            self.embeds, self.ids = embeds[:, n:], ids[:, n:]
            if self.embeds.shape[1] > 1:
                return None
        deltas = rope_deltas(lm, kwargs, 1)
        logits = None
        if not (
            _text_last(self.loaded, self.prepared) and set(kwargs) <= _POSITION_ONLY
        ):
            output = lm(
                self.ids,
                inputs_embeds=self.embeds,
                cache=self.cache,
                logits_to_keep=1,
                **kwargs,
            )
            logits = output.logits[:, -1, :]
        batch_cache = [to_batch(c) for c in self.cache]
        scores = [None if self._scoring is None else self._scoring.scores()]
        return Prefilled(batch_cache, deltas, logits, scores)


def batch_caches(
    lm: Any, pads: list[int], quant: KVQuant | None = None
) -> list[Any] | None:
    """An empty batch cache per layer, with ``pads`` left padding per row: of
    the kind mlx-vlm's own cache of that layer is, so a sliding-window layer
    (Gemma 3) keeps its window in the batch as it does alone. None when a
    layer keeps another kind of state (a recurrent layer's, Qwen3.5's): such
    a model's prompts are prefilled alone with its own caches, which then
    join the batch. ``quant``: plain KV layers are quantized so."""
    api = vlm()
    caches: list[Any] = []
    layers = api.make_prompt_cache(lm)
    for index, layer in enumerate(layers):
        if isinstance(layer, api.RotatingKVCache) and not layer.keep:
            caches.append(api.BatchRotatingKVCache(layer.max_size, pads))
        elif type(layer).__name__ == "KVCache":
            caches.append(batch_layer(index, len(layers), pads, quant))
        else:
            return None
    return caches


def _prefill_kwargs(extra: dict[str, Any], embedded: Any) -> dict[str, Any]:
    found = {
        k: val
        for k, val in embedded.to_dict().items()
        if k != "inputs_embeds" and val is not None
    }
    return {**extra, **found}


def build_prompt(
    loaded: LoadedModel,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] = (),
    template_kwargs: Sequence[tuple[str, Any]] = (),
) -> str:
    """The prompt text from the model's chat template.

    Images in every turn count: the image markers stay in their own messages.
    A chat with videos goes to the chat template as it is, image and video
    markers in place (mlx-vlm's own formatting would move its videos ahead
    of the text); so does a chat with audio (``{"type": "audio"}`` markers),
    through the tokenizer's own rendering of the template (Gemma 4's
    processor would move every audio file to the end of its turn).
    ``tools`` (OpenAI's tool definitions) and ``template_kwargs`` (a
    request's ``chat_template_kwargs``) reach the template as keyword
    arguments.
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
