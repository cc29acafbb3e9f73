"""Describing a model folder and counting tokens never call MLX off the worker thread.

MLX streams are thread-local: a thread that touches MLX while another has used it
can make the process abort at exit ("terminate called without an active
exception", exit code 134). Discovery describes folders on a Qt pool thread and
the attachments pool counts tokens, so both must stay clear of MLX. Each test runs
a fresh interpreter, so nothing this pytest process imported hides a call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.models.folder import read_weight_headers
from engine.models.info import inspect_model_dir, layer_kinds
from tests.engine.tinymodels import ARCHS, make_tiny_model_dir

ROOT = Path(__file__).resolve().parents[3]

# Wraps every function of mlx.core and its submodules to record the calling
# thread's name, then runs the worker's load on "worker" and a describe, a
# discovery and a token count on pool threads.
RECORDER = textwrap.dedent(
    """
    import collections, json, sys, threading
    import mlx.core as mx

    calls = collections.Counter()

    def wrap(module):
        for name in dir(module):
            function = getattr(module, name)
            if name.startswith("_") or isinstance(function, type) or not callable(function):
                continue
            def recorder(*args, _f=function, _n=name, **kwargs):
                calls[(threading.current_thread().name, _n)] += 1
                return _f(*args, **kwargs)
            setattr(module, name, recorder)

    for module in (mx, mx.random, mx.fast, mx.linalg, mx.metal):
        wrap(module)

    folder, parent = sys.argv[1], sys.argv[2]
    from engine.models.discovery import discover_models
    from engine.models.info import inspect_model_dir
    from engine.models.loader import load_model

    def run(name, target):
        thread = threading.Thread(target=target, name=name)
        thread.start()
        thread.join()

    loaded = {}
    run("worker", lambda: loaded.update(model=load_model(folder, probe=False)))
    found = {}
    run("pool-describe", lambda: found.update(info=inspect_model_dir(folder).architecture))
    run("pool-discover", lambda: found.update(models=len(discover_models(
        [parent], include_hf_cache=False, include_lmstudio=False, include_longleaf=False
    ).models)))
    run("pool-tokens", lambda: found.update(tokens=len(
        loaded["model"].tokenizer.encode("Longleaf pines", add_special_tokens=False))))
    by_thread = collections.defaultdict(list)
    for (thread, name), count in calls.items():
        by_thread[thread].append(name)
    print(json.dumps({"found": found, "calls": by_thread}))
    """
)

# A worker thread uses MLX, then four pool threads each describe the folder: with
# module building on those threads this aborted at exit in 6 runs of 6.
ABORT_REPRO = textwrap.dedent(
    """
    import sys, threading
    import mlx.core as mx
    from engine.models.info import inspect_model_dir

    def worker():
        a = mx.random.normal((64, 64))
        mx.eval(a @ a)

    threads = [threading.Thread(target=worker)]
    threads += [threading.Thread(target=inspect_model_dir, args=(sys.argv[1],)) for _ in range(4)]
    for thread in threads:
        thread.start()
        thread.join()
    print("described")
    """
)


def _python(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True,
        cwd=ROOT, env=env, timeout=300,
    )


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("thread-models"), "llama")


def test_describe_discover_and_count_tokens_call_no_mlx_off_the_worker(llama_dir: Path) -> None:
    done = _python(RECORDER, str(llama_dir), str(llama_dir.parent))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["found"] == {"info": "llama", "models": 1, "tokens": report["found"]["tokens"]}
    assert report["found"]["tokens"] > 0
    calls = report["calls"]
    # The recorder sees the worker's MLX calls, so it would see any other thread's.
    assert "load" in calls.get("worker", []) or "eval" in calls.get("worker", [])
    assert {thread: names for thread, names in calls.items() if thread != "worker"} == {}


def test_process_exits_cleanly_after_describing_on_pool_threads(llama_dir: Path) -> None:
    done = _python(ABORT_REPRO, str(llama_dir))
    assert "terminate called" not in done.stderr
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "described"


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_kinds_from_config_and_headers_match_mlx_lms_cache(
    tiny_model_root: Path, arch: str
) -> None:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from engine.models.info import classify_layers

    folder = make_tiny_model_dir(tiny_model_root, arch)
    config = json.loads((folder / "config.json").read_text())
    model, _ = load(str(folder))
    expected = classify_layers(make_prompt_cache(model))
    assert layer_kinds(config, read_weight_headers(folder)) == expected
    assert inspect_model_dir(folder).attention_layer_indices == tuple(
        sorted(expected["full"] + expected["sliding"])
    )
