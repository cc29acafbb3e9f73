"""Whole-generation benchmark: the engine's Session vs mlx-lm's own generate loop.

Both sides use the same loaded model (same weights, same compute dtype), the same
prompt token ids (the chat-template rendering of one user message) and greedy
sampling, and both generate exactly ``max_tokens`` tokens (end-of-turn tokens do
not stop a benchmark run, so every run decodes the same number of steps).

- engine: ``engine.session.session.Session(mode).chat(...)``, the code path the worker runs
  (paged cache, chunked prefill of ``Session``'s default chunk size).
- mlx-lm: ``mlx_lm.generate.generate_step`` with a fresh ``make_prompt_cache`` and
  ``kv_bits`` None / 8 / 6 / 4 (group 64, ``quantized_kv_start=0`` so the cache is
  quantized from the first chunk, not only past mlx-lm's default 5000 tokens), its
  default 2048-token prefill step.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from benchmarks.report import fmt_ratio, fmt_tokens, machine_lines, ratio, table
from engine.cache.kvquant import MODES, bits_for
from engine.cache.modes import FP16, KvMode

if TYPE_CHECKING:
    from engine.models.loader import LoadedModel
    from engine.session.sampling import SamplingParams

# Public-domain sentences (Thoreau, Walden, 1854), repeated and varied by a counter
# so the prompt is long and not one token pattern.
PASSAGE = (
    "I went to the woods because I wished to live deliberately, to front only the "
    "essential facts of life, and see if I could not learn what it had to teach, and "
    "not, when I came to die, discover that I had not lived. Our life is frittered "
    "away by detail. Simplify, simplify. The mass of men lead lives of quiet "
    "desperation. Heaven is under our feet as well as over our heads. "
)
QUESTION = "\n\nSummarise the passage above in one sentence."


@dataclass(frozen=True)
class GenerateBenchConfig:
    """Sizes of one ``benchmarks generate`` run."""

    model: str = "demo"
    prompts: tuple[int, ...] = (1024, 4096, 7168)
    modes: tuple[KvMode, ...] = tuple(MODES)
    max_tokens: int = 64
    repeats: int = 1


QUICK = GenerateBenchConfig(prompts=(512, 1024), max_tokens=16)


def prompt_messages(tokenizer: Any, target_tokens: int, render: Callable) -> list[dict]:
    """One user message whose rendered prompt is close to ``target_tokens`` tokens."""
    parts: list[str] = []
    count = 0
    while count < target_tokens + 64:
        parts.append(f"({len(parts) + 1}) {PASSAGE}")
        count += len(tokenizer.encode(parts[-1], add_special_tokens=False))
    ids = tokenizer.encode("".join(parts), add_special_tokens=False)
    overhead = len(render([{"role": "user", "content": QUESTION}]))
    body = tokenizer.decode(ids[: max(1, target_tokens - overhead)])
    return [{"role": "user", "content": body + QUESTION}]


def _sampling(max_tokens: int) -> SamplingParams:
    from engine.session.sampling import SamplingParams

    # One token a pass, as mlx_lm.generate decodes (the speculative bench has its own rows).
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0, speculative="off")


def run_engine(
    loaded: LoadedModel, mode: KvMode, messages: list[dict], max_tokens: int
) -> dict[str, Any]:
    """One greedy answer through a fresh engine Session in ``mode``."""
    from engine.session.session import Session

    session = Session("bench", loaded, mode)
    session.end_ids = frozenset()  # decode exactly max_tokens steps, like mlx-lm below
    tokens: list[int] = []

    def collect(event: object) -> None:
        tokens.extend(getattr(event, "token_ids", ()) or ())

    mx.clear_cache()
    mx.reset_peak_memory()
    _, stats = session.chat(
        messages,
        _sampling(max_tokens),
        request_id=1,
        cancel=threading.Event(),
        emit=collect,
        tick=lambda: None,
    )
    result = {
        "prompt_tokens": stats.prompt_tokens,
        "generated": stats.generated_tokens,
        "prefill_tps": stats.prefill_tps,
        "decode_tps": stats.decode_tps,
        "peak_bytes": mx.get_peak_memory(),
        "tokens": tokens,
    }
    session.close()
    return result


def mlx_group_size(head_dim: int) -> int:
    """mlx-lm's default KV group (64), or 32 for heads it does not divide (tiny test models)."""
    return 64 if head_dim % 64 == 0 else 32


def run_mlx_lm(
    model: Any, prompt: list[int], bits: int | None, max_tokens: int, model_head_dim: int
) -> dict:
    """One greedy answer through mlx-lm's generate_step, timed as stream_generate does."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    mx.clear_cache()
    mx.reset_peak_memory()
    tokens: list[int] = []
    start = time.perf_counter()
    first = last = start
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=max_tokens,
        prompt_cache=make_prompt_cache(model),
        kv_bits=bits,
        kv_group_size=mlx_group_size(model_head_dim),
        quantized_kv_start=0,
    )
    for token, _ in steps:
        last = time.perf_counter()
        if not tokens:
            first = last
        tokens.append(int(token))
    decode_seconds = last - first
    return {
        "prompt_tokens": len(prompt),
        "generated": len(tokens),
        "prefill_tps": len(prompt) / (first - start),
        "decode_tps": (len(tokens) - 1) / decode_seconds if decode_seconds > 0 else 0.0,
        "peak_bytes": mx.get_peak_memory(),
        "tokens": tokens,
    }


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median decode rate (tokens are identical across greedy runs)."""
    ordered = sorted(runs, key=lambda r: r["decode_tps"])
    return ordered[len(ordered) // 2]


def run_generate_bench(
    config: GenerateBenchConfig,
    progress: Callable[[str], None] = print,
    partial_results: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Time every mode against mlx-lm at every prompt length; plain-value results.

    ``partial_results`` gets the results so far after each prompt length, so a long
    run that is stopped still leaves its finished lengths behind.
    """
    from engine.models.loader import load_model

    loaded = load_model(config.model)
    info = loaded.info
    rows: list[dict[str, Any]] = []
    results = {
        "config": dataclasses.asdict(config),
        "model": {
            "name": info.name,
            "architecture": info.architecture,
            "layers": info.num_layers,
            "kv_heads": info.kv_heads,
            "head_dim": info.head_dim,
            "quantization_bits": info.quantization_bits,
            "dtype": "float32" if mx.default_device() == mx.cpu else "as stored",
        },
        "rows": rows,
    }
    render = partial(loaded.tokenizer.apply_chat_template, add_generation_prompt=True)
    warm = prompt_messages(loaded.tokenizer, 64, render)
    for mode in config.modes:  # compile kernels and warm allocators, untimed
        bits = None if mode == FP16 else bits_for(mode)
        run_engine(loaded, mode, warm, 2)
        run_mlx_lm(loaded.model, list(render(warm)), bits, 2, info.head_dim)
    for target in config.prompts:
        messages = prompt_messages(loaded.tokenizer, target, render)
        prompt = list(render(messages))
        for mode in config.modes:
            bits = None if mode == FP16 else bits_for(mode)
            ours, theirs = [], []
            for _ in range(config.repeats):
                progress(f"prompt {len(prompt)} tokens, {mode}: engine")
                ours.append(run_engine(loaded, mode, messages, config.max_tokens))
                progress(f"prompt {len(prompt)} tokens, {mode}: mlx-lm")
                theirs.append(
                    run_mlx_lm(loaded.model, prompt, bits, config.max_tokens, info.head_dim)
                )
            rows.append(
                {"target": target, "mode": mode, "engine": _best(ours), "mlx_lm": _best(theirs)}
            )
        if partial_results is not None:
            partial_results(results)
    return results


def _finished(targets: list[int], rows: list[dict[str, Any]]) -> list[str]:
    return [fmt_tokens(t) for t in targets if any(r["target"] == t for r in rows)]


def _weight_bits(bits: int | None) -> str:
    return "unquantized" if bits is None else f"{bits}-bit"


def agreement(a: list[int], b: list[int]) -> str:
    """How far two greedy outputs agree: ``matching/total`` and the first divergence."""
    total = min(len(a), len(b))
    same = sum(x == y for x, y in zip(a, b, strict=False))
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    diverge = "identical" if first is None else f"first differs at {first}"
    return f"{same}/{total} ({diverge})"


SPEED_HEADERS = (
    "prompt tokens",
    "mode",
    "mlx-lm cache",
    "engine decode tok/s",
    "mlx-lm decode tok/s",
    "decode engine / mlx-lm",
    "engine prefill tok/s",
    "mlx-lm prefill tok/s",
    "prefill engine / mlx-lm",
    "peak MLX memory engine / mlx-lm (MiB)",
)


def render_generate_report(
    results: dict[str, Any], info: dict[str, Any], command: str, load_after: str
) -> str:
    """The Markdown body of the generate benchmark's section."""
    config, model = results["config"], results["model"]
    rows = results["rows"]
    speed, agree = [], []
    for row in rows:
        ours, theirs = row["engine"], row["mlx_lm"]
        mlx_name = "KVCache" if row["mode"] == "fp16" else f"kv_bits={bits_for(row['mode'])}"
        speed.append(
            (
                ours["prompt_tokens"],
                row["mode"],
                mlx_name,
                f"{ours['decode_tps']:.1f}",
                f"{theirs['decode_tps']:.1f}",
                fmt_ratio(ratio(ours["decode_tps"], theirs["decode_tps"])),
                f"{ours['prefill_tps']:.0f}",
                f"{theirs['prefill_tps']:.0f}",
                fmt_ratio(ratio(ours["prefill_tps"], theirs["prefill_tps"])),
                f"{ours['peak_bytes'] / 2**20:.0f} / {theirs['peak_bytes'] / 2**20:.0f}",
            )
        )
        fp16_row = next(
            (r for r in rows if r["target"] == row["target"] and r["mode"] == "fp16"), None
        )
        engine_fp16 = None if fp16_row is None else fp16_row["engine"]["tokens"]
        agree.append(
            (
                ours["prompt_tokens"],
                row["mode"],
                agreement(ours["tokens"], theirs["tokens"]),
                "—" if engine_fp16 is None else agreement(ours["tokens"], engine_fp16),
            )
        )
    lines = [
        "## Generation: engine vs mlx-lm's generate (`python -m benchmarks generate`)",
        "",
        f"Command: `{command}`",
        "",
        *machine_lines(info, load_after),
        "",
        f"Model: {model['name']} ({model['architecture']}, {model['layers']} layers, "
        f"{model['kv_heads']} KV heads of {model['head_dim']}, weights "
        f"{_weight_bits(model['quantization_bits'])}, compute dtype {model['dtype']}). "
        f"Greedy, {config['max_tokens']} tokens per run, end-of-turn ignored so both sides "
        f"decode the same number of steps; prompts are the same token ids on both sides "
        f"(targets {', '.join(fmt_tokens(p) for p in config['prompts'])}; "
        f"finished: {', '.join(_finished(config['prompts'], rows)) or 'none'}). "
        f"Median of {config['repeats']} run(s) per cell.",
        "",
        "The engine runs `Session.chat` (paged cache, the session's default prefill chunk); "
        "mlx-lm runs `generate_step` with a fresh `make_prompt_cache` and `kv_bits` "
        f"None/8/6/4 (group {mlx_group_size(model['head_dim'])}, `quantized_kv_start=0`, so "
        "its cache is quantized from the first prefill chunk rather than only past its "
        "default 5000 tokens). Ratios above 1 favour the engine (they are tokens per second).",
        "",
        "### Speed",
        "",
        *table(SPEED_HEADERS, speed),
        "",
        "### Greedy agreement (token ids)",
        "",
        *table(
            ("prompt tokens", "mode", "engine vs mlx-lm, same bits", "engine vs engine fp16"),
            agree,
        ),
    ]
    return "\n".join(lines) + "\n"
