"""A model folder's fingerprint: what must match before stored KV may be reused.

KV rows are only meaningful to the exact weights that made them, so the
fingerprint covers ``config.json`` (its bytes) and every safetensors weight
file's name, size and header (names, dtypes, shapes and offsets of every
tensor), plus a hash of the first and last 64 KiB of its tensor data: two
fine-tunes of one architecture share config, sizes and headers, and only the
weights tell them apart. Reading headers and samples, not whole weights, keeps
it cheap at any model size.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from engine.errors import EngineError

_HEADER_LENGTH = struct.Struct("<Q")
_SAMPLE_BYTES = 64 * 1024


def _weight_facts(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    with open(path, "rb") as source:
        prefix = source.read(_HEADER_LENGTH.size)
        if len(prefix) != _HEADER_LENGTH.size:
            raise EngineError(f"{path.name} is too short to be a safetensors file.")
        (length,) = _HEADER_LENGTH.unpack(prefix)
        header = source.read(length)
        sample = hashlib.sha256(source.read(_SAMPLE_BYTES))
        source.seek(max(source.tell(), size - _SAMPLE_BYTES))
        sample.update(source.read(_SAMPLE_BYTES))
    return {
        "name": path.name,
        "size": size,
        "header_sha256": hashlib.sha256(prefix + header).hexdigest(),
        "sample_sha256": sample.hexdigest(),
    }


def model_fingerprint(folder: str | Path) -> dict[str, Any]:
    """The fingerprint of a model folder as plain JSON values.

    Returns:
        ``{"digest", "config_sha256", "weights": [{"name", "size", "header_sha256",
        "sample_sha256"}]}``;
        two folders hold the same model when their digests are equal.

    Raises:
        EngineError: the folder has no ``config.json`` or a weight file is unreadable.
    """
    folder = Path(folder)
    try:
        config = (folder / "config.json").read_bytes()
        weights = [_weight_facts(p) for p in sorted(folder.glob("*.safetensors"))]
    except OSError as error:
        raise EngineError(f"Cannot read the model folder {folder}: {error}") from error
    facts = {"config_sha256": hashlib.sha256(config).hexdigest(), "weights": weights}
    canonical = json.dumps(facts, sort_keys=True, separators=(",", ":"))
    return {"digest": hashlib.sha256(canonical.encode()).hexdigest(), **facts}


def session_model_dir(session: Any) -> Path:
    """The folder of the model a ``Session`` runs.

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
