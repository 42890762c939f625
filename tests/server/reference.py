"""The oracle the engine is compared with: ``mlx_vlm.stream_generate``, one
request alone on the model, turned into the engine's events.

mlx-vlm's own generation loop is the reference for batched-equals-solo: the
server's engine must give the same tokens and log-probabilities whether a
request runs alone or in a batch, and the same as this loop. Text is cut
and decoded by the engine's own (separately tested) text pieces, so events
compare equal field by field.
"""

from __future__ import annotations

import importlib
from collections.abc import Generator, Sequence
from typing import Any, cast

import mlx.core as mx
from PIL import Image

from mlx_pinned.server.engine import LoadedModel
from mlx_pinned.server.engine.answers import StopMatcher, TextDecoder
from mlx_pinned.server.engine.model_inputs import build_prompt
from mlx_pinned.server.events import (
    Event,
    FinalEvent,
    FinishReason,
    GenerationParams,
    TokenEvent,
    TokenLogprobs,
)


def reference_stream(
    loaded: LoadedModel,
    params: GenerationParams,
    images: Sequence[Image.Image] = (),
) -> Generator[Event, None, None]:
    """``mlx_vlm.stream_generate`` for one request, as engine events; run it
    on the thread the model was loaded on, alone on the model."""
    utils = importlib.import_module("mlx_vlm.utils")
    stream_generate = importlib.import_module("mlx_vlm.generate").stream_generate
    sampling = params.sampling
    if sampling.seed is not None:
        mx.random.seed(sampling.seed % 2**64)
    prompt = build_prompt(loaded, params.messages)
    model, processor = loaded.model, loaded.processor
    inputs = dict(
        utils.prepare_inputs(
            processor,
            images=list(images) or None,
            audio=[audio.samples for audio in params.audios] or None,
            prompts=prompt,
            image_token_index=getattr(model.config, "image_token_index", None),
            add_special_tokens=utils.should_add_special_tokens(
                model.config.model_type, processor
            ),
        )
    )
    inputs["mask"] = inputs.pop("attention_mask", None)
    inputs.setdefault("pixel_values", None)
    most = params.max_tokens_for(int(inputs["input_ids"].shape[-1]))
    kwargs: dict[str, Any] = {"max_tokens": most}
    for name in ("temperature", "top_p", "seed"):
        if getattr(sampling, name) is not None:
            kwargs[name] = getattr(sampling, name)
    if sampling.logit_bias:
        kwargs["logit_bias"] = dict(sampling.logit_bias)
    inner = stream_generate(model, processor, prompt, **inputs, **kwargs)
    matcher = StopMatcher(params.stop)
    decoder = TextDecoder(processor, lambda t: loaded.token_text(t)[1])
    finish: FinishReason = "length"
    tail = ""
    prompt_tokens = completion = 0
    try:
        for result in inner:
            prompt_tokens = result.prompt_tokens
            if result.finish_reason is not None:  # holds no new token
                tail, stopped = matcher.feed(decoder.finish(result.text))
                finish = "stop" if stopped or result.finish_reason == "stop" else finish
                break
            text, stopped = matcher.feed(decoder.add(result.token, result.text))
            completion += 1
            logprobs = None
            if sampling.logprobs:
                logprobs = _logprobs(loaded, result.token, result.logprobs, params)
            yield TokenEvent(text, logprobs)
            if stopped:
                finish = "stop"
                break
    finally:
        inner.close()
    tail += matcher.flush()
    yield FinalEvent(tail, finish, prompt_tokens, completion, stop_reason=matcher.hit)


def _logprobs(
    loaded: LoadedModel, token: int, logprobs: mx.array, params: GenerationParams
) -> TokenLogprobs:
    chosen = logprobs[token]
    k = min(params.sampling.top_logprobs, logprobs.shape[-1])
    pairs: list[tuple[int, float]] = []
    if k:
        indices = mx.argpartition(-logprobs, kth=k - 1)[:k]
        values = logprobs[indices]
        ids = cast("list[int]", indices.tolist())
        scores = cast("list[float]", values.tolist())
        pairs = sorted(zip(ids, scores, strict=True), key=lambda p: -p[1])
    text, raw = loaded.token_text(token)
    top = []
    for index, value in pairs:
        alt_text, alt_raw = loaded.token_text(index)
        top.append((alt_text, value, alt_raw))
    return TokenLogprobs(text, cast("float", chosen.item()), raw, top)
