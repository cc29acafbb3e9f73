"""Rebuild Hugging Face tokenizer files from a GGUF file's tokenizer metadata.

llama.cpp stores a byte-level BPE tokenizer as three parallel lists (tokens, token
types, merges) plus a named pre-tokenizer. mlx-lm loads tokenizers through
``transformers``, which wants ``tokenizer.json`` and ``tokenizer_config.json``;
this module writes those from the metadata alone, so conversion stays offline.
"""

from __future__ import annotations

from typing import Any

from engine.errors import ModelLoadError

# llama.cpp's token type for control tokens (<|im_start|> and friends).
CONTROL_TOKEN = 3

BYTE_LEVEL = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": True,
    "use_regex": True,
}

# Pre-tokenizers by llama.cpp's `tokenizer.ggml.pre` name. SmolLM2 (and the
# StarCoder family it inherits from) isolates every digit, then applies the
# GPT-2 split pattern that ByteLevel carries built in.
PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, BYTE_LEVEL],
    },
    "starcoder": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, BYTE_LEVEL],
    },
    "gpt-2": BYTE_LEVEL,
}


def _scalar(metadata: dict[str, Any], key: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    return int(value.item()) if hasattr(value, "item") else int(value)


def _flag(metadata: dict[str, Any], key: str) -> bool:
    value = metadata.get(key)
    if value is None:
        return False
    return bool(value.item()) if hasattr(value, "item") else bool(value)


def _token_types(metadata: dict[str, Any], count: int) -> list[int]:
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
        return [1] * count
    return [int(t) for t in (types.tolist() if hasattr(types, "tolist") else types)]


def tokenizer_json(metadata: dict[str, Any]) -> dict[str, Any]:
    """Build a ``tokenizer.json`` document from GGUF tokenizer metadata.

    Args:
        metadata: the metadata dict ``mx.load(path, return_metadata=True)`` returns.

    Returns:
        The tokenizer as a JSON-ready dict for the ``tokenizers`` library.

    Raises:
        ModelLoadError: the GGUF tokenizer is not byte-level BPE with a known
            pre-tokenizer, so a faithful rebuild is not possible.
    """
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(
            f"The GGUF tokenizer type {model!r} is not supported; only byte-level BPE "
            "('gpt2') tokenizers can be converted. Use an mlx-lm model folder instead."
        )
    pre_name = metadata.get("tokenizer.ggml.pre", "gpt-2")
    if pre_name not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"The GGUF pre-tokenizer {pre_name!r} is not supported (known: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}). Use an mlx-lm model folder instead."
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types = _token_types(metadata, len(tokens))
    added = [
        {
            "id": index,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for index, (token, kind) in enumerate(zip(tokens, types, strict=True))
        if kind == CONTROL_TOKEN
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre_name],
        "post_processor": {**BYTE_LEVEL, "trim_offsets": False},
        "decoder": BYTE_LEVEL,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {token: index for index, token in enumerate(tokens)},
            "merges": list(metadata.get("tokenizer.ggml.merges", [])),
        },
    }


def tokenizer_config_json(metadata: dict[str, Any], max_context: int) -> dict[str, Any]:
    """Build ``tokenizer_config.json``: special tokens and the chat template.

    The GGUF's BOS/EOS/padding ids name the special tokens; for ChatML models the
    EOS is ``<|im_end|>``, which makes it the end-of-turn token generation stops on.
    """
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types = _token_types(metadata, len(tokens))

    def token_at(key: str) -> str | None:
        index = _scalar(metadata, key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_prefix_space": _flag(metadata, "tokenizer.ggml.add_space_prefix"),
        "add_bos_token": _flag(metadata, "tokenizer.ggml.add_bos_token"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_context,
        "bos_token": token_at("tokenizer.ggml.bos_token_id"),
        "eos_token": token_at("tokenizer.ggml.eos_token_id"),
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
        "additional_special_tokens": [
            token for token in ("<|im_start|>", "<|im_end|>") if token in tokens
        ],
        "added_tokens_decoder": {
            str(index): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for index, (token, kind) in enumerate(zip(tokens, types, strict=True))
            if kind == CONTROL_TOKEN
        },
    }
    template = metadata.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return {key: value for key, value in config.items() if value is not None}
