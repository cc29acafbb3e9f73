"""The tiny model fixtures load and run in mlx-lm with mlx-lm's own caches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import stream_generate
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from tests.engine.tinymodels import (
    ARCHS,
    EOS_TOKEN,
    TINY_SLIDING_WINDOW,
    load_tiny,
    make_tiny_model_dir,
)

MESSAGES = [{"role": "user", "content": "How do longleaf pines survive fire?"}]


def _config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def test_folder_is_a_complete_mlx_lm_model(tiny_model_dir: Path) -> None:
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = _config(tiny_model_dir)
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert config["head_dim"] % 32 == 0  # every KV mode and MLX group size applies
    assert config["model_type"] in ARCHS


def test_generates_with_mlx_lm_cache(tiny_model: tuple[Any, Any]) -> None:
    model, tokenizer = tiny_model
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert len(prompt) > TINY_SLIDING_WINDOW  # long enough to rotate gemma's window
    cache = make_prompt_cache(model)
    responses = list(
        stream_generate(
            model, tokenizer, prompt, max_tokens=6, sampler=make_sampler(0.0),
            prompt_cache=cache,
        )
    )
    assert 1 <= len(responses) <= 6
    assert responses[-1].prompt_tokens == len(prompt)
    assert all(0 <= r.token < model.args.vocab_size for r in responses)
    # mlx-lm computes one token ahead of what it yields, so the cache may hold it too.
    held = {len(prompt) + len(responses) - 1, len(prompt) + len(responses)}
    attention = [c for c in cache if isinstance(c, KVCache | RotatingKVCache)]
    assert attention and all(c.offset in held for c in attention)


def test_incremental_decode_matches_full_forward(tiny_model: tuple[Any, Any]) -> None:
    model, _ = tiny_model
    tokens = mx.array([[(7 * i + 3) % 300 + 3 for i in range(40)]])
    full = model(tokens)[0, -1]
    cache = make_prompt_cache(model)
    model(tokens[:, :24], cache=cache)
    for step in range(24, 40):
        last = model(tokens[:, step : step + 1], cache=cache)[0, -1]
    assert np.allclose(np.array(last), np.array(full), atol=1e-4, rtol=1e-4)


def test_chat_template_and_eos(tiny_model: tuple[Any, Any]) -> None:
    _, tokenizer = tiny_model
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>user\nHow do longleaf pines survive fire?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids(EOS_TOKEN)}
    sample = "Zürich café 東京 🌲 def f(x): return x ** 2"
    assert tokenizer.decode(tokenizer.encode(sample)) == sample
    assert tokenizer.encode(EOS_TOKEN) == [tokenizer.convert_tokens_to_ids(EOS_TOKEN)]


@pytest.mark.parametrize("tiny_model_dir", ["qwen3_next"], indirect=True)
def test_qwen3_next_is_hybrid(tiny_model: tuple[Any, Any]) -> None:
    model, _ = tiny_model
    cache = make_prompt_cache(model)
    kinds = [type(c) for c in cache]
    assert kinds == [ArraysCache, KVCache, ArraysCache, KVCache]
    assert [layer.is_linear for layer in model.layers] == [True, False, True, False]
    model(mx.array([[5, 6, 7, 8, 9]]), cache=cache)
    assert cache[0].state[0] is not None and cache[1].offset == 5


@pytest.mark.parametrize("tiny_model_dir", ["gemma3_text"], indirect=True)
def test_gemma3_mixes_sliding_and_global_layers(tiny_model: tuple[Any, Any]) -> None:
    model, _ = tiny_model
    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == [RotatingKVCache, KVCache, RotatingKVCache, KVCache]
    assert all(c.max_size == TINY_SLIDING_WINDOW for c in cache[::2])
    tokens = mx.array([list(range(3, 3 + 3 * TINY_SLIDING_WINDOW))])
    model(tokens, cache=cache)
    model(mx.array([[5]]), cache=cache)
    # The window rotated: sliding layers keep only its tokens, global layers keep all.
    assert cache[0].state[0].shape[2] == TINY_SLIDING_WINDOW
    assert cache[1].offset == 3 * TINY_SLIDING_WINDOW + 1


@pytest.mark.parametrize("tiny_model_dir", ["gemma3_text"], indirect=True)
def test_gemma3_window_changes_the_output(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Against the same weights with a window wider than the context: if rotation did
    # not matter, a test for the paged equivalent could not tell right from wrong.
    narrow, _ = load_tiny(tiny_model_dir.parent, "gemma3_text")
    wide, _ = load_tiny(tmp_path, "gemma3_text", sliding_window=4096)
    tokens = mx.array([[(5 * i + 1) % 300 + 3 for i in range(3 * TINY_SLIDING_WINDOW)]])
    difference = mx.max(mx.abs(narrow(tokens)[0, -1] - wide(tokens)[0, -1])).item()
    assert difference > 1e-3


def test_weights_are_seeded_and_overrides_get_their_own_folder(tmp_path: Path) -> None:
    first = make_tiny_model_dir(tmp_path, "llama")
    again = make_tiny_model_dir(tmp_path / "again", "llama")
    other_seed = make_tiny_model_dir(tmp_path, "llama", seed=1)
    deeper = make_tiny_model_dir(tmp_path, "llama", num_hidden_layers=3)
    assert len({first, other_seed, deeper}) == 3
    a, b, c = (mx.load(str(d / "model.safetensors")) for d in (first, again, other_seed))
    name = "model.layers.0.self_attn.k_proj.weight"
    assert np.array_equal(np.array(a[name]), np.array(b[name]))
    assert not np.array_equal(np.array(a[name]), np.array(c[name]))
    model, _ = load_tiny(tmp_path, "llama", num_hidden_layers=3)
    assert len(model.layers) == 3


def test_dtype_option(tmp_path: Path) -> None:
    model, _ = load_tiny(tmp_path, "qwen3", dtype="bfloat16")
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16


def test_unknown_arch_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="known: llama"):
        make_tiny_model_dir(tmp_path, "gpt2")


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])  # tied and untied output heads
def test_an_endless_model_never_ends_its_turn(tmp_path: Path, arch: str) -> None:
    from engine.session.prompt_ids import end_of_turn_ids

    model, tokenizer = load_tiny(tmp_path, arch, endless=True)
    assert make_tiny_model_dir(tmp_path, arch, endless=True) != make_tiny_model_dir(tmp_path, arch)
    ends = end_of_turn_ids(tokenizer)
    assert ends
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    tokens = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=300,
                                               sampler=make_sampler(temp=0.0))]
    assert len(tokens) == 300 and not ends & set(tokens)
