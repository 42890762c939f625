"""BERT, as an embedding model (a bidirectional encoder that mlx-vlm's
embedding loader, ``mlx_vlm.embedding_loader``, loads, mean-pooled and
normalised) and as a reranker (the same encoder with a one-logit
classifier over its pooled first token, a cross-encoder that mlx-vlm's
``mlx_vlm.reranker_loader`` loads). Calling thread.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Final

from ._configs import token_files
from ._family import Family, flat
from ._tokenizer import VOCAB_SIZE, ids, tokenizer_json

#: BERT's special tokens, in id order (``[PAD]`` is id 0).
SPECIAL_TOKENS: Final = ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]")

#: The tiny model's position embeddings: its longest input, in tokens.
MAX_POSITIONS: Final = 128

#: The widths it may be cut to (``dimensions``): it says it was trained so
#: (Matryoshka), as EmbeddingGemma's and Qwen3-Embedding's configs do.
MATRYOSHKA_DIMENSIONS: Final = (16, 32, 64)

_IDS: Final = ids(SPECIAL_TOKENS)


@functools.cache
def _config() -> dict[str, Any]:
    return {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "hidden_act": "gelu",
        "max_position_embeddings": MAX_POSITIONS,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "pad_token_id": _IDS["[PAD]"],
        "matryoshka_dimensions": list(MATRYOSHKA_DIMENSIONS),
        "dtype": "float32",
    }


@functools.cache
def _reranker_config() -> dict[str, Any]:
    config = {**_config(), "architectures": ["BertForSequenceClassification"]}
    del config["matryoshka_dimensions"]
    return {**config, "num_labels": 1, "id2label": {"0": "LABEL_0"}}


def _build_reranker(module: Any, config: dict[str, Any]) -> Any:
    return module.SequenceClassificationModel(module.ModelConfig.from_dict(config))


def _files() -> dict[str, Any]:
    files = token_files(
        SPECIAL_TOKENS, "", bos="[CLS]", eos="[SEP]", pad="[PAD]", unk_token="[UNK]"
    )
    files["tokenizer_config.json"].pop("chat_template")
    files["tokenizer_config.json"]["model_max_length"] = MAX_POSITIONS
    names = ["input_ids", "token_type_ids", "attention_mask"]  # BERT's
    files["tokenizer_config.json"]["model_input_names"] = names
    return files


def _tokenizer(specials: tuple[str, ...]) -> bytes:
    """The byte-level BPE tokenizer, with BERT's ``[CLS] ... [SEP]`` around
    every text (and ``[SEP]`` between the two of a pair, a reranker's)."""
    data = json.loads(tokenizer_json(specials))
    cls, sep = ("[CLS]", _IDS["[CLS]"]), ("[SEP]", _IDS["[SEP]"])
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "[CLS]", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "[SEP]", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": "[CLS]", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "[SEP]", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
            {"SpecialToken": {"id": "[SEP]", "type_id": 1}},
        ],
        "special_tokens": {
            token: {"id": token, "ids": [index], "tokens": [token]}
            for token, index in (cls, sep)
        },
    }
    return json.dumps(data, ensure_ascii=False).encode("utf-8")


BERT: Final = Family(
    "bert",
    SPECIAL_TOKENS,
    _config,
    _files,
    build=flat,
    embeddings=(),
    vision=False,
    tokenizer=_tokenizer,
    generator="make_tiny_embedding",
)

BERT_RERANKER: Final = Family(
    "bert",
    SPECIAL_TOKENS,
    _reranker_config,
    _files,
    build=_build_reranker,
    embeddings=(),
    vision=False,
    name="bert_reranker",
    tokenizer=_tokenizer,
    generator="make_tiny_reranker",
)
