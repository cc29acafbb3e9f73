"""Model discovery over fake Hugging Face caches, LM Studio folders and user folders.

Every layout is built on disk in the test's temp dirs (conftest points HF_HOME,
XDG dirs and LONGLEAF_HOME there; HOME is patched for LM Studio), holding real
tiny mlx-lm model files so ``inspect_model_dir`` reads genuine headers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from engine.models import discovery
from engine.models.discovery import (
    MANIFEST_NAME,
    DiscoveredModel,
    SkippedModel,
    discover_models,
    hf_hub_cache,
)
from engine.models.download_plan import destination_for
from engine.paths import models_dir
from tests.engine.tinymodels import make_tiny_model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("discovery-models"), "llama")


@pytest.fixture(scope="module")
def tiny_odd_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 30: fine for fp16/q8/q4, impossible for q6's 4-values-in-3-bytes packing.
    return make_tiny_model_dir(tmp_path_factory.mktemp("discovery-odd"), "llama", head_dim=30)


@pytest.fixture(autouse=True)
def fake_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    return home


def add_to_hf_cache(
    cache: Path, repo_id: str, files: dict[str, bytes], *, repo_type: str = "model"
) -> Path:
    """Lay files out the way huggingface_hub does: blobs, snapshot symlinks, refs."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def model_files(folder: Path, **config_changes: object) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    if config_changes:
        config = json.loads(files["config.json"])
        config.update(config_changes)
        files["config.json"] = json.dumps(config).encode()
    return files


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def by_name(found: tuple) -> dict:
    return {entry.name: entry for entry in found}


def test_hf_cache_models_and_the_reasons_others_are_skipped(tiny_llama: Path) -> None:
    cache = hf_hub_cache()
    assert cache == Path(os.environ["HF_HOME"]) / "hub"
    files = model_files(tiny_llama)
    snapshot = add_to_hf_cache(cache, "mlx-community/tiny-llama", files)
    add_to_hf_cache(cache, "bartowski/tiny-GGUF", {"tiny-Q4_K_M.gguf": b"GGUF" + bytes(64)})
    add_to_hf_cache(
        cache, "meta/tiny-torch", {"config.json": files["config.json"], "pytorch_model.bin": b"pt"}
    )
    add_to_hf_cache(cache, "someone/alien", model_files(tiny_llama, model_type="not_a_model"))
    add_to_hf_cache(cache, "someone/tokenizer-only", {"tokenizer.json": files["tokenizer.json"]})
    add_to_hf_cache(cache, "someone/corpus", {"data.safetensors": b"x"}, repo_type="dataset")

    found = discover_models(include_lmstudio=False, include_longleaf=False)

    models = by_name(found.models)
    assert list(models) == ["mlx-community/tiny-llama"]
    model = models["mlx-community/tiny-llama"]
    assert model.source == discovery.HUGGINGFACE
    assert model.path == snapshot
    assert model.size_bytes == sum(len(data) for data in files.values())
    assert model.info.head_dim == 32
    assert model.mode_notes == {}

    skipped = by_name(found.skipped)
    assert set(skipped) == {
        "bartowski/tiny-GGUF", "meta/tiny-torch", "someone/alien", "someone/tokenizer-only"
    }
    assert "GGUF" in skipped["bartowski/tiny-GGUF"].reason
    assert "mlx_lm.convert" in skipped["meta/tiny-torch"].reason
    assert "not_a_model" in skipped["someone/alien"].reason
    assert "No .safetensors" in skipped["someone/tokenizer-only"].reason
    assert all(isinstance(s, SkippedModel) and s.source == "huggingface" for s in skipped.values())


def test_hf_hub_cache_variable_wins_over_hf_home(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_to_hf_cache(Path(os.environ["HF_HOME"]) / "hub", "old/ignored", model_files(tiny_llama))
    custom = tmp_path / "elsewhere"
    add_to_hf_cache(custom, "mlx-community/moved", model_files(tiny_llama))
    monkeypatch.setenv("HF_HUB_CACHE", str(custom))

    found = discover_models(include_lmstudio=False, include_longleaf=False)

    assert [m.name for m in found.models] == ["mlx-community/moved"]


def test_lmstudio_folders(tiny_llama: Path, fake_home: Path) -> None:
    current = fake_home / ".lmstudio" / "models"
    older = fake_home / ".cache" / "lm-studio" / "models"
    copy_model(tiny_llama, current / "mlx-community" / "Tiny-4bit")
    (older / "lmstudio-community" / "Tiny-GGUF").mkdir(parents=True)
    (older / "lmstudio-community" / "Tiny-GGUF" / "tiny-Q8_0.gguf").write_bytes(b"GGUF")

    found = discover_models(include_hf_cache=False, include_longleaf=False)

    assert [(m.name, m.source) for m in found.models] == [("mlx-community/Tiny-4bit", "lmstudio")]
    assert found.models[0].size_bytes == discovery.folder_size(tiny_llama)
    [gguf] = found.skipped
    assert gguf.name == "lmstudio-community/Tiny-GGUF" and "GGUF" in gguf.reason


def test_longleaf_folder_with_finished_and_unfinished_downloads(tiny_llama: Path) -> None:
    done = copy_model(tiny_llama, destination_for("mlx-community/done"))
    (done / MANIFEST_NAME).write_text(
        json.dumps({"repo_id": "mlx-community/done", "commit": COMMIT, "complete": True})
    )
    half = destination_for("mlx-community/half")
    half.mkdir(parents=True)
    (half / "config.json").write_bytes((tiny_llama / "config.json").read_bytes())
    (half / MANIFEST_NAME).write_text(
        json.dumps({"repo_id": "mlx-community/half", "commit": COMMIT, "complete": False})
    )
    (models_dir() / ".SmolLM2.staging").mkdir()  # a conversion in progress is invisible
    copy_model(tiny_llama, models_dir() / ".SmolLM2.staging" / "m")

    found = discover_models(include_hf_cache=False, include_lmstudio=False)

    assert [(m.name, m.source, m.path) for m in found.models] == [
        ("mlx-community/done", "longleaf", done)
    ]
    [unfinished] = found.skipped
    assert unfinished.name == "mlx-community/half"
    assert "Download not finished" in unfinished.reason


def test_user_folders_model_or_parent_deduplicated(tiny_llama: Path, tmp_path: Path) -> None:
    parent = tmp_path / "my-models"
    first = copy_model(tiny_llama, parent / "first")
    copy_model(tiny_llama, parent / "group" / "second")
    (parent / "notes").mkdir()
    (parent / "notes" / "readme.txt").write_text("not a model")

    found = discover_models(
        [parent, first, str(first)], include_hf_cache=False, include_lmstudio=False
    )

    assert [(m.name, m.source) for m in found.models] == [
        ("first", "folder"), ("group/second", "folder")
    ]
    assert found.skipped == ()


def test_q6_is_flagged_when_head_dim_is_not_a_multiple_of_four(tiny_odd_head: Path) -> None:
    found = discover_models([tiny_odd_head], include_hf_cache=False, include_lmstudio=False)

    [model] = found.models
    assert isinstance(model, DiscoveredModel)
    assert model.head_dim == 30
    assert list(model.mode_notes) == ["q6"]
    assert "head_dim 30 is not a multiple of 4" in model.mode_notes["q6"]


def test_missing_shards_and_missing_config_are_reported(tiny_llama: Path, tmp_path: Path) -> None:
    sharded = copy_model(tiny_llama, tmp_path / "sharded")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    no_config = copy_model(tiny_llama, tmp_path / "no-config")
    (no_config / "config.json").unlink()

    found = discover_models(
        [sharded, no_config], include_hf_cache=False, include_lmstudio=False
    )

    assert found.models == ()
    reasons = {s.name: s.reason for s in found.skipped}
    assert "model-00002-of-00002.safetensors" in reasons["sharded"]
    assert "No config.json" in reasons["no-config"]


def test_a_config_of_the_wrong_types_is_skipped_and_the_rest_still_listed(
        tiny_llama: Path, tmp_path: Path) -> None:
    """One hand-edited folder must not empty the picker: it is skipped with a reason."""
    bad = copy_model(tiny_llama, tmp_path / "heads-as-text")
    config = json.loads((bad / "config.json").read_text())
    config["num_attention_heads"] = str(config["num_attention_heads"])
    config.pop("head_dim", None)
    (bad / "config.json").write_text(json.dumps(config))
    odd_index = copy_model(tiny_llama, tmp_path / "odd-index")
    (odd_index / "model.safetensors.index.json").write_text('{"weight_map": ["a", "b"]}')
    bom = copy_model(tiny_llama, tmp_path / "bom")
    (bom / "config.json").write_text((tiny_llama / "config.json").read_text(),
                                     encoding="utf-8-sig")

    found = discover_models([tmp_path], include_hf_cache=False, include_lmstudio=False)

    assert [m.name for m in found.models] == ["odd-index"]
    reasons = {s.name: s.reason for s in found.skipped}
    assert "does not describe a valid llama model" in reasons["heads-as-text"]
    # mlx-lm's own reading of config.json refuses the mark: said, not "download again".
    assert "save it again as UTF-8 without BOM" in reasons["bom"]


def test_missing_locations_are_fine(tmp_path: Path) -> None:
    found = discover_models([tmp_path / "does-not-exist"])
    assert found.models == () and found.skipped == ()


def test_the_demo_models_folder_is_marked_as_the_demo(tiny_llama: Path) -> None:
    from engine.models.demo import DEMO_NAME

    assert discovery.DEMO_FOLDER == DEMO_NAME  # the folder ensure_demo_model fills
    demo = copy_model(tiny_llama, models_dir() / DEMO_NAME)
    other = copy_model(tiny_llama, models_dir() / "other")

    found = discover_models(include_hf_cache=False, include_lmstudio=False)

    # The picker lists the demo once, as "Demo", with these facts; not a second time.
    assert sorted((m.path, m.source) for m in found.models) == sorted(
        [(demo, discovery.DEMO), (other, discovery.LONGLEAF)])
