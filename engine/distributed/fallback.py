"""After a pipeline is lost: whether its model can go on on this machine alone.

The app and the API server both answer on this machine's in-process engine when
a pipeline's group is gone, if the model's weights fit here; this is the part
of that decision they share (no Qt, nothing loaded).
"""

from __future__ import annotations

from engine.errors import EngineError


def fits_here(path: str) -> str:
    """"" when the model's weights fit in this machine's free memory, else why not (the
    engine's own message); from the weight headers, without loading anything."""
    from engine.memory.guard import MemoryGuard
    from engine.models.loader import estimate_load_bytes, resolve_model_path

    try:
        folder = resolve_model_path(path)
        needed, quantized = estimate_load_bytes(folder)
        MemoryGuard().check_load(needed, name=folder.name, quantized=quantized)
    except EngineError as error:
        return str(error)
    return ""
