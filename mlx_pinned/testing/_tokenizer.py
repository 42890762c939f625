"""The tiny models' byte-level BPE tokenizers, trained offline with
``tokenizers`` on a few embedded sentences. Calling thread; no MLX.

Each family brings its own special tokens; the trainer gives them the first
ids, in order, so a family's token ids are fixed by its list. A bench model's
vocabulary is the same tokenizer padded with generated words.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Final

VOCAB_SIZE: Final = 384

_CORPUS: Final = (
    "Describe this image in one sentence.",
    "What is in this picture? Answer in a few words.",
    "You are a helpful assistant that describes images.",
    "The quick brown fox jumps over the lazy dog.",
    "A small red square sits on a blue background.",
    "There is a cat on the table next to a cup of tea.",
    "Please write a short story about a robot and a garden.",
    "The weather today is sunny with a light breeze from the sea.",
    "Count the objects in the image and list their colours.",
    "Hello! How can I help you today?",
    "Thank you, that was very helpful.",
    "The model runs on one thread that owns its stream.",
    "Green trees, white clouds, yellow sun and a grey road.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Is this a photo of a dog, a cat or a bird?",
    "Summarise the text below in one paragraph, please.",
)


@functools.cache
def tokenizer_json(specials: tuple[str, ...]) -> bytes:
    """Train the byte-level BPE tokenizer with ``specials``, once per process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE or any(
        tokenizer.token_to_id(token) != index for index, token in enumerate(specials)
    ):
        # The corpus is fixed, so this only happens if `tokenizers` changes.
        raise RuntimeError(
            f"The tiny tokenizer came out with {tokenizer.get_vocab_size()} tokens "
            "or moved its special tokens; adjust _CORPUS in "
            "mlx_pinned/testing/_tokenizer.py."
        )
    return tokenizer.to_str().encode("utf-8")


# Syllables of the padding words: 70 of them, so three make 343,000 words.
_ONSETS: Final = "bdfgklmnprstvz"
_VOWELS: Final = "aeiou"


def padded(tokenizer: bytes, size: int) -> bytes:
    """``tokenizer`` (a ``tokenizer.json``) with ``size`` tokens: the new ids
    are words of three generated syllables after a space (``" kelumo"``).

    No merge makes them, so no text encodes to one, but a model may pick one
    and it decodes as a word: a vocabulary as large as a real model's, for
    what sampling and the LM head cost.
    """
    data = json.loads(tokenizer)
    vocab: dict[str, int] = data["model"]["vocab"]
    syllables = [onset + vowel for onset in _ONSETS for vowel in _VOWELS]
    count = len(syllables)
    index = 0
    while len(vocab) < size:
        # A prime stride, so that words of every first syllable come early.
        number = index * 7919 % count**3
        parts = (number // count**2, number // count % count, number % count)
        word = "\u0120" + "".join(syllables[part] for part in parts)  # Ġ: a space
        index += 1
        if word not in vocab:
            vocab[word] = len(vocab)
    return json.dumps(data, ensure_ascii=False).encode("utf-8")


def ids(specials: tuple[str, ...]) -> dict[str, int]:
    """Token ids of the special tokens (the trainer gives them the first)."""
    return {token: index for index, token in enumerate(specials)}


def high_byte_ids(specials: tuple[str, ...]) -> list[int]:
    """Token ids of the single bytes 0x80-0xFF in the byte-level vocabulary."""
    # GPT-2's byte-to-character table, which the ByteLevel pre-tokenizer uses.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    shifted = [byte for byte in range(256) if byte not in printable]
    as_char = {byte: chr(byte) for byte in printable}
    as_char.update({byte: chr(256 + n) for n, byte in enumerate(shifted)})
    vocab: dict[str, int] = json.loads(tokenizer_json(specials))["model"]["vocab"]
    return sorted(vocab[as_char[byte]] for byte in range(0x80, 0x100))


def tokenizer_config(
    specials: tuple[str, ...],
    chat_template: str,
    *,
    bos: str | None,
    eos: str,
    pad: str,
    **extra: Any,
) -> dict[str, Any]:
    """``tokenizer_config.json``: every special token marked special."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_decoder": {
            str(index): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for index, token in enumerate(specials)
        },
        "chat_template": chat_template,
        **extra,
    }
