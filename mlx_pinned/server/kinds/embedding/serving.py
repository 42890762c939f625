"""Embeddings' one validation site: a parsed request checked against the
served model before it waits for the gate. Event loop. A text's length in
tokens is checked by the engine, which tokenizes on the MLX thread."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...http.errors import APIError
from ...http.serving_common import out_of_vocabulary

if TYPE_CHECKING:
    from ...config import ImageLimits
    from ...media import ImageRef
    from .protocol import EmbeddingRequest
    from .values import EmbeddingFacts, EmbeddingParams

__all__ = ["EmbeddingsServing"]


class EmbeddingsServing:
    def prepare(
        self, request: EmbeddingRequest, facts: EmbeddingFacts, limits: ImageLimits
    ) -> tuple[EmbeddingParams, list[ImageRef]]:
        """``request``'s embedding request and its images, in prompt order;
        a 400 names what the model cannot take."""
        params = request.to_embedding_params()
        refs = request.image_refs(limits)
        if refs and not facts.accepts_images:
            message = "this model embeds no images; send text only."
            raise refs[0].error(message, "images_unsupported")
        if params.messages and not facts.has_chat_template:
            raise APIError(
                400,
                "Invalid parameter 'messages': this model has no chat template "
                "to render a conversation; send 'input' instead.",
                param="messages",
                code="invalid_value",
            )
        if params.dimensions is not None:
            check_dimensions(params.dimensions, facts)
        vocab = facts.vocab_size
        for item in params.inputs:
            if isinstance(item, tuple):
                outside = next((token for token in item if token >= vocab), None)
                if outside is not None:
                    raise out_of_vocabulary("input", outside, vocab)
        return params, refs


def check_dimensions(dimensions: int, facts: EmbeddingFacts) -> None:
    """Refuse (400, naming ``dimensions``) a width the model was not trained
    to be cut to: its cut vectors would be poor."""
    why = facts.refuses_width(dimensions)
    if why is not None:
        raise APIError(
            400,
            f"Invalid value for 'dimensions': {dimensions}; {why}.",
            param="dimensions",
            code="invalid_value",
        )
