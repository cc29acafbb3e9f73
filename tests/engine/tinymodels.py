"""Tiny random-weight mlx-lm model folders for tests (no network, no hub).

``make_tiny_model_dir(tmp_path, "qwen3_next")`` writes a real mlx-lm model folder:
``config.json``, ``model.safetensors`` (seeded random weights built by mlx-lm's own
model class, so names and shapes always match it) and a byte-level BPE tokenizer
trained on a bundled text snippet, with a ChatML chat template and ``<|im_end|>``
as end-of-sequence. ``mlx_lm.load`` and ``mlx_lm.generate`` work on it.

Every arch uses GQA (4 query heads, 2 KV heads) and a head_dim divisible by 32, so
every KV mode, including q6 and MLX's affine group of 32, applies. ``qwen3_next`` is
hybrid (gated-delta linear attention and full attention layers, MoE MLPs) and
``gemma3_text`` alternates sliding-window and global layers with a window of
``TINY_SLIDING_WINDOW`` tokens, far below the contexts tests use, so the rotating
caches really rotate.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten

ARCHS: tuple[str, ...] = ("llama", "qwen3", "qwen3_next", "gemma3_text")
TINY_SLIDING_WINDOW = 16
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", EOS_TOKEN)
TOKENIZER_VOCAB = 400

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Enough varied English, code and punctuation for a few hundred BPE merges.
CORPUS = """\
Longleaf pines grow in the sandy coastal plain. Their needles are long, their cones
are heavy, and fire keeps the forest floor open. The quick brown fox jumps over the
lazy dog; the five boxing wizards jump quickly. How vexingly quick daft zebras jump!
def attention(queries, keys, values, scale):
    scores = queries @ keys.T * scale
    return softmax(scores, axis=-1) @ values
A paged cache holds pages of 256 tokens. Each page stores codes and scales for the
keys and values of every head. When the budget runs out, the cache says how many
tokens fit and which mode would fit more. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 1024.
User: What is the capital of France? Assistant: The capital of France is Paris.
User: Summarise this document, please. Assistant: Here is a short summary.
{"role": "user", "content": "hello"} [1, 2, 3] (a + b) * c / d - e % f = g < h > i
Symbols: ~ ` ! @ # $ ^ & | \\ ' " ? , . : ; _ - + = { } [ ] ( ) < >
Unicode: café, naïve, Zürich, 東京, Ελληνικά, emoji 🌲🔥.
"""

_HEAD = {"num_attention_heads": 4, "num_key_value_heads": 2}

BASE_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        **_HEAD,
        "head_dim": 32,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        **_HEAD,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        "hidden_size": 64,
        # (i + 1) % 2 != 0 is linear: layers 0, 2 gated-delta, layers 1, 3 full attention.
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "intermediate_size": 128,
        **_HEAD,
        "head_dim": 32,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        # i % 2 == 1 is global: layers 0, 2 slide over the window, layers 1, 3 see all.
        "num_hidden_layers": 4,
        "sliding_window_pattern": 2,
        "sliding_window": TINY_SLIDING_WINDOW,
        "intermediate_size": 128,
        **_HEAD,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "max_position_embeddings": 4096,
    },
}


@functools.cache
def tokenizer_json() -> str:
    """A byte-level BPE ``tokenizer.json``, trained once per process (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tokenizer.to_str()


def tokenizer_vocab_size() -> int:
    """Number of tokens in the tiny tokenizer (also the models' vocab size)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json()).get_vocab_size()


def tiny_config(arch: str, **overrides: Any) -> dict[str, Any]:
    """The ``config.json`` contents for ``arch``, with top-level keys overridden."""
    if arch not in BASE_CONFIGS:
        raise ValueError(f"No tiny config for arch {arch!r}; known: {', '.join(ARCHS)}")
    from tokenizers import Tokenizer

    eos_id = Tokenizer.from_str(tokenizer_json()).token_to_id(EOS_TOKEN)
    config = {**BASE_CONFIGS[arch], "vocab_size": tokenizer_vocab_size(), "eos_token_id": eos_id}
    config.update(overrides)
    return config


def _random_weights(config: dict[str, Any], seed: int, dtype: mx.Dtype) -> dict[str, mx.array]:
    from engine.cache.mlx_lm_compat import model_classes

    model_class, args_class = model_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # tree_flatten returns a dict only when handed one to fill; here its list.
    parameters = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    weights = {name: value.astype(dtype) for name, value in parameters}
    if config["model_type"] == "gemma3_text":
        # Gemma checkpoints tie the output head to the embedding; mlx-lm ties on load.
        weights.pop("lm_head.weight")
    return weights


def _silence_end_of_turn(weights: dict[str, mx.array]) -> None:
    # A zero row scores 0 for every hidden state, while the largest of the other
    # random logits is positive for all but a vanishing share of states.
    from tokenizers import Tokenizer

    from engine.session.prompt_ids import END_OF_TURN

    tokenizer = Tokenizer.from_str(tokenizer_json())
    ids = [i for i in (tokenizer.token_to_id(marker) for marker in (EOS_TOKEN, *END_OF_TURN))
           if i is not None]
    name = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    head = weights[name]
    rows = mx.arange(head.shape[0])
    ending = mx.zeros((head.shape[0],), dtype=mx.bool_)
    for i in ids:
        ending = ending | (rows == i)
    weights[name] = mx.where(ending[:, None], mx.zeros_like(head), head)


def _write_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    special = {"eos_token": EOS_TOKEN, "pad_token": "<|endoftext|>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def make_tiny_model_dir(
    tmp_path: Path, arch: str, *, seed: int = 0, dtype: str = "float32", endless: bool = False,
    **overrides: Any
) -> Path:
    """Write a tiny random-weight mlx-lm model folder and return its path.

    Args:
        tmp_path: parent folder (e.g. pytest's ``tmp_path``).
        arch: one of ``ARCHS``.
        seed: seed of the random weights; same seed, same weights.
        dtype: weight dtype name ("float32", "float16", "bfloat16"); float32 by
            default because the CPU backend emulates float16.
        endless: zero the output rows of every end-of-turn token, so that greedy
            decoding never ends an answer by itself (for tests that act mid-answer
            and must not race the model's own end of turn).
        **overrides: top-level ``config.json`` keys to replace (e.g. num_hidden_layers).

    Returns:
        The folder, named after arch and a hash of its config so that different
        overrides in one ``tmp_path`` never collide.
    """
    config = tiny_config(arch, **overrides)
    key = json.dumps([config, seed, dtype, endless], sort_keys=True)
    folder = Path(tmp_path) / f"tiny-{arch}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    weights = _random_weights(config, seed, getattr(mx, dtype))
    if endless:
        _silence_end_of_turn(weights)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(folder)
    # Written last: its presence marks the folder complete.
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    return folder


def load_tiny(tmp_path: Path, arch: str, **kwargs: Any) -> tuple[Any, Any]:
    """Build (or reuse) a tiny model folder and load it with ``mlx_lm.utils.load``.

    Returns:
        ``(model, tokenizer)``: mlx-lm's model and its ``TokenizerWrapper``.
    """
    return _load(make_tiny_model_dir(tmp_path, arch, **kwargs))


def _load(folder: Path) -> tuple[Any, Any]:
    """mlx-lm's ``(model, tokenizer)`` of ``folder``."""
    from mlx_lm.utils import load

    # Without return_config, load returns these two; its annotation is the
    # union of that and the three it returns with it.
    return cast("tuple[Any, Any]", load(str(folder)))


def loaded_for_session(folder: Path, max_context: int = 4096) -> Any:
    """A tiny model folder loaded the way ``engine.session.session.Session`` takes it
    (model, tokenizer, info with its context and path, folder)."""
    from types import SimpleNamespace

    model, tokenizer = _load(folder)
    info = SimpleNamespace(max_context=max_context, path=str(folder))
    return SimpleNamespace(model=model, tokenizer=tokenizer, info=info, folder=folder)


def load_tiny_model(folder: Path) -> SimpleNamespace:
    """A tiny model folder loaded by mlx-lm, with the facts a ``Session`` reads."""
    model, tokenizer = _load(folder)
    config = json.loads((folder / "config.json").read_text())
    info = SimpleNamespace(max_context=config["max_position_embeddings"])
    return SimpleNamespace(model=model, tokenizer=tokenizer, info=info, folder=folder)
