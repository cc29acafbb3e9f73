"""Peak extra memory of saving and loading one KV snapshot.

``python -m benchmarks.snapshot_memory --mib 64`` fills a paged cache shaped
like the demo model's (30 layers, 3 KV heads, head_dim 64) with random rows up
to about that many MiB of pages, then saves it with ``save_snapshot`` and reads
it back with ``load_snapshot``, each in a fresh child process, and reports how
far each step raised the process's peak resident memory (Linux ``VmHWM``, reset
just before the step) and MLX's peak allocation above what was held before.
No model weights are needed: the model folder holds only a ``config.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from engine.cache.modes import Q8, KvMode, parse_mode

# The cache builders are the tests' own (the tests of snapshots use the same caches).
from tests.engine.snapshot_fixtures import (
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    PAGE_SIZE,
    cache_session,
    config_only_model,
    filled_cache,
)

ROOT = Path(__file__).resolve().parents[1]
_CHILD = """
import json, sys
from benchmarks.snapshot_memory import child
print(json.dumps(child(*sys.argv[1:])))
"""


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    Path("/proc/self/clear_refs").write_text("5")


def _measure(step: Callable[[], object]) -> dict[str, float]:
    import mlx.core as mx

    mx.clear_cache()
    rss = _status_kib("VmRSS")
    active = mx.get_active_memory()
    _reset_peak()
    mx.reset_peak_memory()
    step()
    return {"extra_rss_mib": (_status_kib("VmHWM") - rss) / 1024,
            "extra_mlx_mib": (mx.get_peak_memory() - active) / 2**20}


def child(action: str, folder: str, mode: str, tokens: str) -> dict[str, float]:
    """One step in this process: "save" a filled cache, or "load" it back."""
    from engine.snapshots import load_snapshot, save_snapshot

    model_dir = Path(folder) / "model"
    tokens_n = int(tokens)
    if action == "save":
        session = cache_session(filled_cache(mode, tokens_n), tokens_n, mode, model_dir)
        result = _measure(lambda: save_snapshot(session, Path(folder) / "kv", "chat"))
        result["kv_mib"] = sum(layer.nbytes for layer in session.cache) / 2**20
        return result
    # A cache that held the pages once and gave them back keeps its storage: the
    # load then measures what it needs beyond the pages themselves.
    cache = filled_cache(mode, tokens_n)
    for layer in cache:
        layer._drop_last(layer.offset, release=False)
    session = cache_session(cache, 0, mode, model_dir)
    session.tokens = []
    session.reset = lambda: None
    prompt = list(range(tokens_n))
    result = _measure(lambda: load_snapshot(session, Path(folder) / "kv", "chat", prompt,
                                            keep_last=False))
    result["kv_mib"] = sum(layer.nbytes for layer in session.cache) / 2**20
    return result


def run(mib: float, mode: KvMode) -> dict[str, dict[str, float]]:
    """Save and load a cache of about ``mib`` MiB in child processes; their numbers."""
    from engine.cache import kvquant

    per_token = LAYERS * KV_HEADS * kvquant.kv_bytes_per_token(HEAD_DIM, mode)
    tokens = int(mib * 2**20 / per_token) // PAGE_SIZE * PAGE_SIZE
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        config_only_model(Path(folder))
        for action in ("save", "load"):
            # From the checkout's root, where ``benchmarks`` is importable (not installed).
            out = subprocess.run([sys.executable, "-c", _CHILD, action, folder, mode, str(tokens)],
                                 capture_output=True, text=True, cwd=ROOT)
            if out.returncode:
                raise RuntimeError(f"{action} failed:\n{out.stderr}")
            results[action] = json.loads(out.stdout.strip().splitlines()[-1])
        results["file_mib"] = sum(p.stat().st_size for p in (Path(folder) / "kv").iterdir()) / 2**20
    results["tokens"] = tokens
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=64.0, help="KV pages to store, in MiB")
    parser.add_argument("--mode", type=parse_mode, default=Q8)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.mib, args.mode), indent=2))


if __name__ == "__main__":
    main()
