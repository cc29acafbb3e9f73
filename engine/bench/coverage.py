"""Which cache every mlx-lm text architecture runs on: ``python -m engine.bench.coverage``.

For each ``model_type`` mlx-lm ships (a module with ``Model`` and ``ModelArgs``)
a tiny config is built from its ``ModelArgs`` (small widths, 4 layers, a 128-token
vocabulary, class defaults for everything else, so default-on features such as
KV-shared layers stay on), the model gets mlx's random initial weights and
:func:`engine.models.probe.probe_model` decides: paged, mlx-lm's own cache, or
refused. Each architecture runs in its own process with a time limit, so a crash
or a hang is a row, not the end of the run. The table goes to ``docs/coverage.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TINY_LAYERS = 4
TINY_VOCAB = 128
TIME_LIMIT_S = 120
NOT_BUILT = "not built"

# Sizes by field name; every other large int that names a width is shrunk by
# _shrink. Heads: 4 query, 2 KV, so GQA is exercised.
_NAMED: dict[str, Any] = {
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "dim": 64, "model_dim": 64,
    "embed_dim": 64, "intermediate_size": 128, "ffn_hidden_size": 128, "ffn_dim": 128,
    "n_inner": 128, "hidden_dim": 128, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "num_hidden_layers": TINY_LAYERS, "n_layer": TINY_LAYERS, "n_layers": TINY_LAYERS,
    "num_layers": TINY_LAYERS, "num_attention_heads": 4, "n_head": 4, "n_heads": 4,
    "num_heads": 4, "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2,
    "multi_query_group_num": 2, "head_dim": 32, "global_head_dim": 64,
    "vocab_size": TINY_VOCAB, "vocab_size_per_layer_input": TINY_VOCAB,
    "hidden_size_per_layer_input": 16, "sliding_window": 16, "sliding_window_pattern": 2,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "top_k_experts": 2, "moe_topk": 2, "n_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "kv_lora_rank": 64, "q_lora_rank": 32, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32,
    "v_head_dim": 32, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "layer_norm_eps": 1e-5,
    "norm_eps": 1e-5, "layer_norm_epsilon": 1e-5, "linear_num_value_heads": 4,
    "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "state_size": 8, "ssm_state_size": 8, "conv_kernel": 4, "time_step_rank": 4,
    # Learned position tables must cover the probe's tokens (MLX does not bounds-check).
    "max_position_embeddings": 4096, "n_positions": 4096, "n_ctx": 4096, "max_seq_len": 4096,
    "seq_length": 4096, "max_sequence_length": 4096, "context_length": 4096,
}
_WIDTH_WORDS = ("size", "dim", "rank", "hidden", "intermediate", "embed", "ffn", "width", "vocab")


@dataclasses.dataclass(frozen=True)
class Row:
    """One architecture's line in the table."""

    model_type: str
    verdict: str
    reason: str
    max_rel_diff: float | None = None
    seconds: float | None = None


def models_dir() -> Path:
    """mlx-lm's ``models`` package folder."""
    import mlx_lm.models

    return Path(mlx_lm.models.__file__).parent


def text_model_types() -> list[str]:
    """Every mlx-lm module that defines both ``Model`` and ``ModelArgs``."""
    found = []
    for path in sorted(models_dir().glob("*.py")):
        source = path.read_text(encoding="utf-8")
        has_model = re.search(r"^class Model\(", source, re.M)
        if has_model and re.search(r"^class ModelArgs", source, re.M):
            found.append(path.stem)
    return found


def tiny_config(model_type: str) -> dict[str, Any]:
    """A small config for ``model_type`` built from its ``ModelArgs`` fields.

    Raises:
        ImportError: mlx-lm has no such module.
    """
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    return _fill(module.ModelArgs, model_type)


def _fill(args_class: type, model_type: str) -> dict[str, Any]:
    config: dict[str, Any] = {"model_type": model_type}
    for field in dataclasses.fields(args_class):
        value = _tiny_value(field, model_type)
        if value is not dataclasses.MISSING:
            config[field.name] = value
    config["model_type"] = model_type
    return config


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _tiny_value(field: dataclasses.Field, model_type: str) -> Any:
    name, default = field.name, _default(field)
    if name == "text_config":
        return _tiny_text_config(model_type, default)
    if name == "num_kv_shared_layers":
        # Kept on when the class turns it on: that is the case the probe must catch.
        on = default is dataclasses.MISSING or (isinstance(default, int) and default > 0)
        return TINY_LAYERS // 2 if on else default
    unset = default is dataclasses.MISSING or default is None
    if name in _NAMED and (unset or type(default) is int):
        return _NAMED[name]
    if name == "layer_types" and (default is dataclasses.MISSING or default == []):
        return ["sliding_attention", "full_attention"] * (TINY_LAYERS // 2)
    if default is dataclasses.MISSING:
        if "layers" in name and str(field.type) in ("int", "<class 'int'>"):
            return TINY_LAYERS // 2  # some layers of a kind (KV reuse, dense), not all
        return _required(name, str(field.type))
    return _shrink(name, default)


def _shrink(name: str, default: Any) -> Any:
    if isinstance(default, bool) or not isinstance(default, int | list):
        return default
    if isinstance(default, list):
        # Per-layer lists sized for the real depth: keep the first layers' entries.
        return default[:TINY_LAYERS] if len(default) > TINY_LAYERS else default
    if "window" in name and default > 16:
        return 16
    if ("rotary" in name or "rope" in name) and "dim" in name and default > 16:
        return 16  # a rotary width may not exceed the tiny head width
    if default > 256 and any(word in name for word in _WIDTH_WORDS):
        return TINY_VOCAB if "vocab" in name else 64
    return default


def _required(name: str, annotation: str) -> Any:
    outer = annotation.lower().removeprefix("typing.").removeprefix("optional[")
    if outer.startswith(("list", "tuple")):
        return []
    if outer.startswith("dict"):
        return {}
    if "bool" in annotation:
        return False
    if "int" in annotation:
        return 4
    if "float" in annotation:
        return 1e-5 if "eps" in name else 10000.0 if "theta" in name else 1.0
    if "str" in annotation:
        return ""
    return {}


def _tiny_text_config(model_type: str, default: Any) -> Any:
    """A multimodal wrapper's ``text_config``: its language model's tiny config."""
    inner = _inner_text_type(model_type)
    if inner:
        return tiny_config(inner)
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    text_class = getattr(module, "TextConfig", None) or getattr(module, "TextArgs", None)
    if text_class is not None and dataclasses.is_dataclass(text_class):
        return _fill(text_class, model_type)
    return default


def _inner_text_type(model_type: str) -> str | None:
    """The language-model module a multimodal wrapper imports (``from . import qwen3``)."""
    source = (models_dir() / f"{model_type}.py").read_text(encoding="utf-8")
    names = re.findall(r"from \.(\w+) import", source) + re.findall(r"from \. import (\w+)", source)
    known = set(text_model_types())
    return next((n for n in names if n in known and n != model_type), None)


def build_tiny(model_type: str) -> Any:
    """The tiny model for ``model_type`` with mlx's random initial weights, in float32."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    config = tiny_config(model_type)
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.float32)
    _randomize_zeros(model)
    mx.eval(model.parameters())
    return model


def _randomize_zeros(model: Any) -> None:
    """Give all-zero parameters (gains, biases) small random values.

    A zero-initialized output gain makes every logit 0 whatever the cache holds,
    and a probe of such a model would pass without checking anything.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    updates = [
        (name, mx.random.normal(value.shape) * 0.02)
        for name, value in tree_flatten(model.parameters())
        if mx.issubdtype(value.dtype, mx.floating) and not mx.any(value).item()
    ]
    if updates:
        model.update(tree_unflatten(updates))


def _load_refusal(model: Any) -> str:
    """What ``load_model`` refuses before any probe: a model with no KV cache to page."""
    from mlx_lm.models.cache import make_prompt_cache

    from engine.models.info import classify_layers

    kinds = classify_layers(make_prompt_cache(model))
    if kinds["full"] or kinds["sliding"]:
        return ""
    return "no attention layers, so no KV cache for Longleaf to page (the loader refuses it)"


def probe_one(model_type: str) -> Row:
    """Build ``model_type``'s tiny model and probe it (in this process)."""
    from engine.models import probe

    try:
        model = build_tiny(model_type)
    except Exception as error:  # any failure of a foreign class is the row's reason
        return Row(model_type, NOT_BUILT, f"could not build a tiny config: {_say(error)}")
    refusal = _load_refusal(model)
    if refusal:
        return Row(model_type, "refused", refusal)
    try:
        informative = probe.depends_on_context(model)
    except Exception:  # mlx-lm fails on this model: the probe below names how
        informative = True
    if not informative:
        return Row(model_type, NOT_BUILT, "the tiny model's logits do not depend on earlier "
                   "tokens, so comparing caches would show nothing")
    start = time.perf_counter()
    result = probe.probe_model(model)
    seconds = round(time.perf_counter() - start, 3)
    if result.verdict == "paged" and not probe.paged_layers_matter(model):
        return Row(model_type, NOT_BUILT, "zeroed pages leave the tiny model's logits as "
                   "they were, so the probe cannot see its paged layers")
    return Row(model_type, result.verdict, result.reason, result.max_rel_diff, seconds)


def probe_in_children(model_types: list[str], time_limit: float = TIME_LIMIT_S) -> list[Row]:
    """``probe_one`` for each type in a child interpreter, ``time_limit`` s per type.

    One child probes types in turn (importing mlx-lm once, not per type); when it
    crashes or overruns, the type in flight gets that row and a new child goes on.
    """
    rows: list[Row] = []
    while len(rows) < len(model_types):
        rows += _run_child(model_types[len(rows) :], time_limit)
    return rows


def _run_child(model_types: list[str], time_limit: float) -> list[Row]:
    command = [sys.executable, "-m", "engine.bench.coverage", "--batch", *model_types]
    # stderr to a file: a pipe nobody reads fills up and stalls a chatty child.
    with tempfile.TemporaryFile(mode="w+") as errors:
        child = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=errors, text=True, bufsize=1
        )
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(child.stdout, lines), daemon=True).start()
        try:
            return _collect(model_types, lines, time_limit, child, errors)
        finally:
            child.kill()
            child.wait()


def _collect(
    model_types: list[str], lines: queue.Queue[str | None], time_limit: float,
    child: subprocess.Popen, errors: Any,
) -> list[Row]:
    rows: list[Row] = []
    for model_type in model_types:
        try:
            line = lines.get(timeout=time_limit)
        except queue.Empty:
            rows.append(Row(model_type, NOT_BUILT, f"the tiny model took over {time_limit:.0f} s"))
            return rows
        if line is None:
            code = child.wait()
            errors.seek(0)
            tail = (errors.read().strip().splitlines() or ["no output"])[-1]
            rows.append(Row(model_type, NOT_BUILT, f"the probe crashed (exit {code}): {tail}"))
            return rows
        rows.append(Row(**json.loads(line)))
        print(f"{model_type}: {rows[-1].verdict} {rows[-1].reason}", file=sys.stderr)
    return rows


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        if line.startswith("{"):
            lines.put(line)
    lines.put(None)


_VERDICT_WORDS = {"paged": "paged", "mlx-lm": "mlx-lm cache", "refused": "refused",
                  NOT_BUILT: NOT_BUILT}


def render(rows: list[Row], mlx_lm_version: str) -> str:
    """``docs/coverage.md``: a summary and one row per model_type."""
    counts = {word: sum(r.verdict == key for r in rows) for key, word in _VERDICT_WORDS.items()}
    summary = ", ".join(f"{count} {word}" for word, count in counts.items())
    lines = [
        "# Model coverage: which KV cache each mlx-lm architecture runs on",
        "",
        f"Generated by `python -m engine.bench.coverage` against mlx-lm {mlx_lm_version}: "
        f"{len(rows)} text architectures, {summary}.",
        "",
        "Each architecture gets a tiny config built from its `ModelArgs` (hidden 64, "
        f"{TINY_LAYERS} layers, 4 query and 2 KV heads, a {TINY_VOCAB}-token vocabulary, "
        "class defaults otherwise) and mlx's random initial weights, in float32 on the "
        "CPU. The load-time probe (`engine/models/probe.py`) then runs "
        "two prefill chunks and decode steps through the paged fp16 cache and through "
        "mlx-lm's own cache and compares the logits:",
        "",
        "- **paged**: the largest logit difference is within fp16 storage rounding "
        "(`MAX_REL_DIFF` of the largest logit); the column gives it. Each such row "
        "was also probed with pages that hold zeros and failed there, so the "
        "comparison does see the paged layers.",
        "- **mlx-lm cache**: the paged cache raised or gave other numbers while "
        "mlx-lm's cache works; the session runs on mlx-lm's cache and says why.",
        "- **refused**: mlx-lm's own cache fails on the tiny model too. This can be "
        "the tiny config's fault rather than the architecture's; the reason says what failed.",
        "- **not built**: no tiny model could be made from the class defaults; no "
        "claim is made either way.",
        "",
        "A row is only as good as its tiny config: a feature a real config turns on "
        "but the class default leaves off is not exercised here. The probe runs "
        "again on every real model at load, and its numbers decide there.",
        "",
        "| model_type | cache | max rel. logit diff | why |",
        "|---|---|---|---|",
    ]
    for row in rows:
        diff = "" if row.max_rel_diff is None else f"{row.max_rel_diff:.1e}"
        reason = row.reason.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{row.model_type}` | {_VERDICT_WORDS[row.verdict]} | {diff} | {reason} |")
    return "\n".join(lines) + "\n"


def _say(error: Exception) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}"[:200] if text else type(error).__name__


def main(argv: list[str] | None = None) -> int:
    """Probe every architecture (or ``--one``) and write the table."""
    parser = argparse.ArgumentParser(prog="python -m engine.bench.coverage")
    parser.add_argument("--batch", nargs="+", help="probe these here, one JSON row a line")
    parser.add_argument("--only", nargs="*", help="model_types to include (default: all)")
    parser.add_argument("--out", default="docs/coverage.md")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S)
    args = parser.parse_args(argv)
    if args.batch:
        for model_type in args.batch:
            print(json.dumps(dataclasses.asdict(probe_one(model_type))), flush=True)
        return 0
    import mlx_lm

    rows = probe_in_children(args.only or text_model_types(), args.time_limit)
    Path(args.out).write_text(render(rows, mlx_lm.__version__), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
