"""Find the models a user already has, and say why the others cannot be opened.

Looks in the Hugging Face hub cache, LM Studio's model folders, Longleaf's own
models folder and any folders the user added. Each candidate folder is read
with ``engine.models.info.inspect_model_dir`` (config and safetensors headers only,
no weights loaded), so listing is fast and needs no MLX device.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from huggingface_hub import scan_cache_dir
from huggingface_hub.errors import CacheNotFound

from engine.cache.modes import MODES, KvMode
from engine.errors import EngineError
from engine.models import DEMO
from engine.paths import models_dir

if TYPE_CHECKING:
    # engine.models.info imports MLX (through kvquant); discovery imports it only
    # when it inspects a folder.
    from engine.models.info import ModelInfo

HUGGINGFACE = "huggingface"
LMSTUDIO = "lmstudio"
LONGLEAF = "longleaf"
FOLDER = "folder"
# engine.models.demo's DEMO_NAME (that module imports MLX): the embedded demo
# model's converted folder in models_dir(), which the picker shows as the demo.
DEMO_FOLDER = "SmolLM2-135M-Instruct"
# Written by engine.models.download into every model folder it fills.
MANIFEST_NAME = ".longleaf-download.json"
# How deep below a root to look for model folders (LM Studio: publisher/model).
SEARCH_DEPTH = 3
_PYTORCH_SUFFIXES = (".bin", ".pth", ".pt")


@dataclass(frozen=True)
class DiscoveredModel:
    """A model mlx-lm can load, with the facts the picker shows.

    Attributes:
        name: display name (the repo id for Hub models, publisher/model for
            LM Studio, the folder name otherwise).
        path: the folder to hand to the loader.
        source: where it was found: "huggingface", "lmstudio", "longleaf", "folder",
            or "demo" for the embedded demo model's converted folder.
        size_bytes: bytes its files take on disk.
        weights_bytes: bytes of its weights (the ``model*.safetensors`` files the
            loader reads): what memory holds, unlike other files a download may
            have left beside them (a ``.gguf``, an ``original/`` checkpoint).
        info: its facts (architecture, params, bits, context,
            KV heads, head_dim, attention layers, KV projection per mode).
    """

    name: str
    path: Path
    source: str
    size_bytes: int
    weights_bytes: int
    info: ModelInfo

    @property
    def head_dim(self) -> int:
        return int(self.info.head_dim)

    @property
    def mode_notes(self) -> dict[KvMode, str]:
        """Why each mode not offered for this model is not: its packed groups
        (four 6-bit values in three bytes, say) do not divide head_dim."""
        return {mode: (f"head_dim {self.head_dim} is not a multiple of "
                       f"{MODES[mode].group_values}, so {mode} cannot store it")
                for mode in self.info.unavailable_modes}


@dataclass(frozen=True)
class SkippedModel:
    """Something that looked like a model but mlx-lm cannot load; ``reason`` says why."""

    name: str
    path: Path
    source: str
    reason: str


@dataclass(frozen=True)
class Discovery:
    """The result of one scan: loadable models and the skipped ones."""

    models: tuple[DiscoveredModel, ...]
    skipped: tuple[SkippedModel, ...]


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache folder, honouring HF_HUB_CACHE and HF_HOME now.

    huggingface_hub reads these variables once at import; reading them per call
    lets a changed environment (or a test) take effect.
    """
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME")
    if not home:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        home = os.path.join(cache, "huggingface")
    return Path(home).expanduser() / "hub"


def lmstudio_roots() -> tuple[Path, ...]:
    """LM Studio's model folders (current and older layouts)."""
    home = Path.home()
    return (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models")


def discover_models(
    extra_folders: Iterable[Path | str] = (),
    *,
    include_hf_cache: bool = True,
    include_lmstudio: bool = True,
    include_longleaf: bool = True,
) -> Discovery:
    """Scan every model location and sort what is found into loadable and skipped.

    Args:
        extra_folders: folders the user added; each may be a model folder or hold
            model folders up to ``SEARCH_DEPTH`` levels down.
        include_hf_cache: scan the Hugging Face hub cache.
        include_lmstudio: scan LM Studio's model folders.
        include_longleaf: scan Longleaf's own models folder.

    Returns:
        Models sorted by name, and skipped candidates with their reasons.
    """
    candidates: list[tuple[str, Path, str, int | None]] = []
    if include_hf_cache:
        candidates += _hf_cache_candidates(hf_hub_cache())
    if include_lmstudio:
        for root in lmstudio_roots():
            candidates += _folder_candidates(root, LMSTUDIO)
    if include_longleaf:
        # An unusable data folder holds no models of Longleaf's own to find.
        with contextlib.suppress(OSError):
            candidates += _folder_candidates(models_dir(), LONGLEAF)
    for folder in extra_folders:
        candidates += _folder_candidates(Path(folder).expanduser(), FOLDER)

    models: list[DiscoveredModel] = []
    skipped: list[SkippedModel] = []
    seen: set[Path] = set()
    for name, path, source, size in candidates:
        key = path.resolve()
        if key in seen:
            continue
        seen.add(key)
        found = inspect_candidate(name, path, source, size)
        if isinstance(found, DiscoveredModel):
            models.append(found)
        else:
            skipped.append(found)
    return Discovery(
        models=tuple(sorted(models, key=lambda m: (m.name.lower(), str(m.path)))),
        skipped=tuple(sorted(skipped, key=lambda s: (s.name.lower(), str(s.path)))),
    )


def inspect_candidate(
    name: str, path: Path, source: str = FOLDER, size_bytes: int | None = None
) -> DiscoveredModel | SkippedModel:
    """Classify one folder: a loadable model, or a skip with a reason to show."""
    reason = unloadable_reason(path)
    if reason is not None:
        return SkippedModel(name, path, source, reason)
    from engine.models.info import inspect_model_dir

    try:
        info = inspect_model_dir(path)
    except EngineError as error:
        return SkippedModel(name, path, source, str(error))
    size = folder_size(path) if size_bytes is None else size_bytes
    return DiscoveredModel(name, path, source, size, weights_size(path), info)


def read_manifest(folder: Path) -> dict | None:
    """Return a download manifest, or None if Longleaf did not download the folder."""
    try:
        return json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None


def unloadable_reason(path: Path) -> str | None:
    """Why a folder's layout rules out mlx-lm, before reading any config.

    Returns None when the folder has a config and safetensors weights; the
    config itself (architecture, attention layers) is judged by
    ``inspect_model_dir``.
    """
    manifest = read_manifest(path)
    if manifest is not None and not manifest.get("complete", False):
        return "Download not finished; resume it from the download dialog."
    reason = layout_problem(p.name for p in _files(path))
    if reason is not None:
        return reason
    missing = _missing_shards(path)
    if missing:
        return (
            f"Incomplete: {len(missing)} weight file(s) listed in "
            f"model.safetensors.index.json are missing (e.g. {missing[0]}). "
            "Finish the download."
        )
    return None


def layout_problem(file_names: Iterable[str]) -> str | None:
    """Why a model with these files cannot be an mlx-lm model, or None if it can be.

    Shared by discovery (folders on disk) and download (a repo's file list).
    """
    names = {Path(name).name.lower() for name in file_names}
    suffixes = {Path(name).suffix for name in names}
    if ".safetensors" not in suffixes:
        if ".gguf" in suffixes:
            return (
                "GGUF only: mlx-lm loads safetensors, not GGUF. Get the MLX version "
                "(e.g. from mlx-community) instead."
            )
        if suffixes & set(_PYTORCH_SUFFIXES):
            return (
                "PyTorch checkpoint only (.bin/.pth): convert it with "
                "`mlx_lm.convert --hf-path <repo>` first."
            )
        return "No .safetensors weights in this folder."
    if "config.json" not in names:
        return "No config.json next to the weights, so the architecture is unknown."
    return None


def folder_size(path: Path) -> int:
    """Bytes taken by a folder's files, following links (the Hub cache uses them)."""
    total = 0
    for root, _, names in os.walk(path, followlinks=True):
        for name in names:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:
                continue
    return total


def weights_size(path: Path) -> int:
    """Bytes of a model folder's ``model*.safetensors`` weights, following links."""
    total = 0
    for file in path.glob("model*.safetensors"):
        try:
            total += file.stat().st_size
        except OSError:
            continue
    return total


def _hf_cache_candidates(cache: Path) -> list[tuple[str, Path, str, int | None]]:
    if not cache.is_dir():
        return []
    try:
        scan = scan_cache_dir(cache)
    except (CacheNotFound, OSError):
        return []
    found: list[tuple[str, Path, str, int | None]] = []
    for repo in scan.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        # The revision "main" points at is what mlx-lm would load by repo id.
        revision = max(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))
        found.append((repo.repo_id, revision.snapshot_path, HUGGINGFACE, revision.size_on_disk))
    return found


def _folder_candidates(root: Path, source: str) -> list[tuple[str, Path, str, int | None]]:
    if not root.is_dir():
        return []
    found: list[tuple[str, Path, str, int | None]] = []
    for folder in _model_folders(root, SEARCH_DEPTH):
        manifest = read_manifest(folder)
        if manifest and manifest.get("repo_id"):
            name = manifest["repo_id"]
        elif folder == root:
            name = folder.name
        else:
            name = folder.relative_to(root).as_posix()
        is_demo = source == LONGLEAF and folder == root / DEMO_FOLDER
        found.append((name, folder, DEMO if is_demo else source, None))
    return found


def _model_folders(folder: Path, depth: int) -> Iterator[Path]:
    """Folders that hold model files; a model folder's subfolders are not searched."""
    if _looks_like_model(folder):
        yield folder
        return
    if depth == 0:
        return
    try:
        children = sorted(p for p in folder.iterdir() if p.is_dir())
    except OSError:
        return
    for child in children:
        if not child.name.startswith("."):
            yield from _model_folders(child, depth - 1)


def _looks_like_model(folder: Path) -> bool:
    for path in _files(folder):
        name = path.name.lower()
        if name == "config.json" or name.endswith((".safetensors", ".gguf", *_PYTORCH_SUFFIXES)):
            return True
    return False


def _files(folder: Path) -> list[Path]:
    try:
        return [p for p in folder.iterdir() if p.is_file()]
    except OSError:
        return []


def _missing_shards(folder: Path) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return []
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except (OSError, ValueError, AttributeError):
        return []
    if not isinstance(weight_map, dict):  # an unreadable index: the headers decide
        return []
    return sorted({str(f) for f in weight_map.values() if not (folder / str(f)).is_file()})
