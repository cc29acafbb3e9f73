"""A model folder's fingerprint: what must match before stored KV may be reused.

KV rows are only meaningful to the exact weights that made them, and a LoRA
merge or an in-place update changes tensors in the middle of a file while
names, shapes and offsets stay the same. So the fingerprint hashes
``config.json`` and every byte of every safetensors weight file (BLAKE3,
streamed). Hashing a large model takes seconds, so each file's digest is kept
in a user-only file in Longleaf's cache folder, keyed by the file's path,
device, inode, size, mtime_ns and ctime_ns: any write to the file changes its
ctime, so a second load of unchanged weights costs a ``stat`` per file.

The worker fingerprints a model once per load (on its own thread) and every
save and reopen of that model's sessions uses that one value.
"""

from __future__ import annotations

import functools
import json
import logging
import marshal
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import blake3

from engine import paths
from engine.errors import EngineError

log = logging.getLogger(__name__)

# Part of every digest: a fingerprint made under other rules never matches.
SCHEME = "blake3-every-byte-1"
_CHUNK_BYTES = 16 * 1024 * 1024
_CACHE_NAME = "weight-digests.json"
# Digests computed or read in this process, by the same key as the file cache.
_known: dict[str, tuple[list[int], str]] = {}


def _stat_key(stat: os.stat_result) -> list[int]:
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _cache_path() -> Path:
    return paths.cache_dir() / _CACHE_NAME


def _read_cache() -> dict[str, Any]:
    try:
        cached = json.loads(_cache_path().read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        log.warning("weight digest cache unreadable, hashing again: %s", error)
        return {}
    return cached if isinstance(cached, dict) and cached.get("scheme") == SCHEME else {}


def _write_cache(entries: dict[str, Any]) -> None:
    temp: Path | None = None
    try:
        path = _cache_path()
        temp = path.with_name(f".{path.name}.{os.getpid()}")
        descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, paths.PRIVATE_FILE_MODE)
        with os.fdopen(descriptor, "w") as out:
            json.dump({"scheme": SCHEME, "files": entries}, out)
        os.replace(temp, path)
    except OSError as error:  # a cache: the next load hashes again
        log.warning("weight digests not cached: %s", error)
        if temp is not None:
            temp.unlink(missing_ok=True)


def hash_file(path: Path) -> str:
    """BLAKE3 of every byte of ``path``, read in fixed-size chunks."""
    digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as source:
        while count := source.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


def _file_digests(files: list[Path]) -> list[dict[str, Any]]:
    """Name, size and digest of each file, from the caches where the key still fits."""
    cached = None
    facts = []
    for path in files:
        resolved = str(path.resolve())
        key = _stat_key(path.stat())
        known = _known.get(resolved)
        if known is None or known[0] != key:
            if cached is None:
                cached = _read_cache().get("files")
                cached = cached if isinstance(cached, dict) else {}
            entry = cached.get(resolved)
            if isinstance(entry, dict) and entry.get("key") == key:
                known = (key, str(entry["blake3"]))
            else:
                known = (key, hash_file(path))
                if _stat_key(path.stat()) != key:  # written while it was read
                    raise EngineError(f"{path.name} changed while Longleaf read it; load again.")
                cached[resolved] = {"key": key, "blake3": known[1]}
                _write_cache(cached)
            _known[resolved] = known
        facts.append({"name": path.name, "size": key[2], "blake3": known[1]})
    return facts


def model_fingerprint(folder: str | Path) -> dict[str, Any]:
    """The fingerprint of a model folder as plain JSON values.

    Returns:
        ``{"digest", "scheme", "config", "weights": [{"name", "size", "blake3"}]}``;
        two folders hold the same model when their digests are equal.

    Raises:
        EngineError: the folder has no ``config.json`` or a weight file is unreadable.
    """
    folder = Path(folder)
    try:
        config = blake3.blake3((folder / "config.json").read_bytes()).hexdigest()
        weights = _file_digests(sorted(folder.glob("*.safetensors")))
    except OSError as error:
        raise EngineError(f"Cannot read the model folder {folder}: {error}") from error
    facts = {"scheme": SCHEME, "config": config, "weights": weights}
    canonical = json.dumps(facts, sort_keys=True, separators=(",", ":"))
    return {"digest": blake3.blake3(canonical.encode()).hexdigest(), **facts}


def code_fingerprint(model_dir: Path) -> dict[str, str]:
    """What computes a model's KV beside its weights, as plain JSON values: MLX's
    version, and a digest of mlx-lm's module for the model's architecture with the
    ``mlx_lm.models`` modules it imports (RoPE, attention helpers). An update of
    either may change every value a layer writes, so stored KV made before it is
    not the KV this version would make.

    Raises:
        EngineError: the folder's ``config.json`` cannot be read, or mlx-lm has no
            module for its architecture.
    """
    try:
        config = json.loads((model_dir / "config.json").read_bytes())
    except (OSError, ValueError) as error:
        raise EngineError(f"Cannot read the model folder {model_dir}: {error}") from error
    try:
        module_name = _module_name(config)
    except (ValueError, KeyError, TypeError) as error:
        raise EngineError(f"mlx-lm has no code for the model in {model_dir}: {error}") from None
    return {"mlx": _mlx_version(), "mlx_lm_model": _source_digest(module_name)}


def session_code(session: object) -> dict[str, str]:
    """``code_fingerprint`` of the model ``session`` runs: the one taken when its
    model was loaded (``LoadedModel.code``), else its folder's now."""
    pinned = getattr(getattr(session, "loaded", None), "code", None)
    if isinstance(pinned, dict) and pinned:
        return pinned
    return code_fingerprint(session_model_dir(session))


def _module_name(config: dict[str, Any]) -> str:
    from engine.cache.mlx_lm_compat import model_classes

    model_class, _args = model_classes(config)
    return str(model_class.__module__)


def _bytecode_digest(module: ModuleType) -> str:
    """BLAKE3 of the bytecode of ``module`` and of the modules of its package its
    names come from (what its relative imports brought in)."""
    package = module.__name__.rpartition(".")[0]
    sources = {value.__name__ if isinstance(value, ModuleType)
               else str(getattr(value, "__module__", "")) for value in vars(module).values()}
    names = sorted(name for name in sources
                   if name.startswith(package + ".") and name != module.__name__)
    digest = blake3.blake3()
    for name in (module.__name__, *names):
        digest.update(_bytecode(name))
    return digest.hexdigest()


def _bytecode(name: str) -> bytes:
    """The marshalled bytecode of module ``name``, as its loader gives it (a loader
    that gives none: the module's name and mlx-lm's version, which a frozen app's
    code changes with)."""
    loader = getattr(sys.modules.get(name), "__loader__", None)
    try:
        code = loader.get_code(name) if loader is not None else None
    except ImportError:
        code = None
    if code is None:
        import mlx_lm

        return f"{name}@{getattr(mlx_lm, '__version__', 'unknown')}".encode()
    return marshal.dumps(code)


def _mlx_version() -> str:
    # The core module's own attribute: a frozen app bundle may carry no package
    # metadata to ask.
    import mlx.core as mx

    return str(getattr(mx, "__version__", "unknown"))


@functools.lru_cache(maxsize=32)
def _source_digest(module_name: str) -> str:
    """BLAKE3 of a model module's source and of each ``mlx_lm.models`` module it
    imports by a relative import (read once per process, as a model loads: the
    module imported then is the code that runs, whatever the disk holds later).
    A frozen app keeps no sources beside its bytecode: there, of the bytecode."""
    module = sys.modules[module_name]
    path = Path(str(module.__file__))
    try:
        source = path.read_bytes()
    except OSError:
        return _bytecode_digest(module)
    names = sorted(set(re.findall(rb"^from \.(\w+) import", source, re.MULTILINE)))
    digest = blake3.blake3(source)
    for name in names:
        imported = path.with_name(name.decode() + ".py")
        if imported.exists():
            digest.update(imported.read_bytes())
    return digest.hexdigest()


def session_model_dir(session: object) -> Path:
    """The folder of the model a session runs (any object that names it).

    Sessions keep the ``LoadedModel``'s ``ModelInfo`` as ``info`` (or the folder as
    ``model_dir``); ``ModelInfo.path`` is the folder.

    Raises:
        EngineError: the session does not say which folder its model came from.
    """
    explicit = getattr(session, "model_dir", None)
    if explicit:
        return Path(explicit)
    loaded = getattr(session, "loaded", None)
    for holder in (getattr(session, "info", None), getattr(loaded, "info", None)):
        path = getattr(holder, "path", None)
        if path:
            return Path(path)
    raise EngineError(
        "This session does not record its model folder, so its KV cache cannot be "
        "stored with a model fingerprint."
    )


def session_fingerprint(session: object) -> dict[str, Any]:
    """The fingerprint of the weights ``session`` runs on.

    The one taken when its model was loaded (``LoadedModel.fingerprint``), so a
    file changed on disk after the load never vouches for KV the old weights
    made; a session built without one fingerprints its model's folder.

    Raises:
        EngineError: the session names no model folder, or it cannot be read.
    """
    pinned = getattr(getattr(session, "loaded", None), "fingerprint", None)
    if isinstance(pinned, dict) and pinned.get("digest"):
        return pinned
    return model_fingerprint(session_model_dir(session))
