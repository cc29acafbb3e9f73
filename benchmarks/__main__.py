"""``python -m benchmarks COMMAND``: cache, generate, batch, agreement, reopen, quality, longctx,
pipeline, serve, speculative, kernels.

Run it with OpenBLAS preloaded on Linux (``source scripts/env.sh``); the report records
which BLAS the process actually loaded.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from engine.cache.modes import KvMode, parse_mode

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "docs" / "benchmark-runs.md"


ConfigT = TypeVar("ConfigT", bound="DataclassInstance")


def with_changes(config: ConfigT, **changes: Any) -> ConfigT:
    """A copy of a bench config with the options the user gave (None: not given)."""
    return replace(config, **{k: v for k, v in changes.items() if v is not None})


def parse_tokens(text: str) -> int:
    """A token count such as ``4096``, ``4k`` or ``16K``."""
    text = text.strip().lower()
    if text.endswith("k"):
        return int(float(text[:-1]) * 1024)
    return int(text)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(parse_tokens(part) for part in text.split(",") if part.strip())


def _modes(text: str) -> tuple[KvMode, ...]:
    return tuple(dict.fromkeys(parse_mode(part) for part in text.split(",") if part.strip()))


def _modes_or_none(text: str) -> tuple[KvMode, ...]:
    return () if text.strip().lower() == "none" else _modes(text)


def _schedules(text: str) -> tuple[str, ...]:
    from engine.cache.attention.schedule import parse

    return tuple(dict.fromkeys(parse(part) for part in text.split(",") if part.strip()))


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="Markdown file")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--quick", action="store_true", help="small sizes, for development")


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``python -m benchmarks``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    cache = sub.add_parser("cache", help="raw attention: paged cache vs mlx-lm caches")
    _common(cache)
    cache.add_argument("--contexts", type=_ints, help="e.g. 4k,16k,32k")
    cache.add_argument("--head-dims", type=_ints, help="e.g. 64,128,256")
    cache.add_argument("--modes", type=_modes, help="e.g. fp16,q8,q6,q4")
    cache.add_argument("--kv-heads", type=int)
    cache.add_argument("--q-heads", type=int)
    cache.add_argument("--prefill-tokens", type=parse_tokens, help="e.g. 16k")
    cache.add_argument("--prefill-chunk", type=parse_tokens)
    cache.add_argument("--prefill-q-heads", type=int)
    cache.add_argument("--prefill-kv-heads", type=int)
    cache.add_argument("--quant-chunk", type=parse_tokens)
    cache.add_argument("--repeats", type=int, help="timed decode steps per contender")
    cache.add_argument("--warmup", type=int, help="untimed decode steps per contender")
    cache.add_argument("--prefill-repeats", type=int)
    cache.add_argument("--quant-repeats", type=int)
    cache.add_argument("--page-size", type=int)

    generate = sub.add_parser("generate", help="demo model: engine vs mlx-lm generate")
    _common(generate)
    generate.add_argument("--model", default="demo", help="model directory or 'demo'")
    generate.add_argument("--prompts", type=_ints, help="prompt lengths, e.g. 1k,4k,7k")
    generate.add_argument("--modes", type=_modes, help="e.g. fp16,q8,q6,q4")
    generate.add_argument("--max-tokens", type=int, help="tokens generated per run")
    generate.add_argument("--repeats", type=int, help="timed runs per contender")

    batch = sub.add_parser("batch", help="demo model: batched decode vs mlx-lm BatchGenerator")
    _common(batch)
    batch.add_argument("--model", default="demo", help="model directory or 'demo'")
    batch.add_argument("--streams", type=_ints, help="stream counts, e.g. 1,2,4,8")
    batch.add_argument("--prompt-tokens", type=parse_tokens, help="tokens a conversation")
    batch.add_argument("--mode", type=parse_mode, help="the engine's KV mode, e.g. q6")
    batch.add_argument("--max-tokens", type=int, help="tokens generated per stream")
    batch.add_argument("--chunk", type=parse_tokens,
                       help="prefill chunk of the document a short question waits beside")

    agree = sub.add_parser("agreement", help="demo model: each mode's greedy ids vs fp16")
    _common(agree)
    agree.add_argument("--model", default="demo", help="model directory or 'demo'")
    agree.add_argument("--prompt", type=parse_tokens, help="prompt length, e.g. 6k")
    agree.add_argument("--modes", type=_modes, help="e.g. q8,q6,q4 (fp16 always runs)")
    agree.add_argument("--max-tokens", type=int, help="tokens generated per mode")

    reopen = sub.add_parser("reopen", help="demo model: reopen a saved chat vs a re-read")
    _common(reopen)
    reopen.add_argument("--model", default="demo", help="model directory or 'demo'")
    reopen.add_argument("--prompts", type=_ints, help="prompt lengths, e.g. 2k,7k")
    reopen.add_argument("--mode", type=parse_mode, help="KV mode, e.g. q8")
    reopen.add_argument("--max-tokens", type=int, help="tokens of the first answer")

    quality = sub.add_parser("quality", help="demo model: teacher-forced KL of each KV storage")
    _common(quality)
    quality.add_argument("--model", default="demo", help="model directory or 'demo'")
    quality.add_argument("--contexts", type=_ints, help="context lengths, e.g. 2k,6k")
    quality.add_argument("--tokens", type=int, help="tokens scored one at a time per context")
    quality.add_argument("--modes", type=_modes, help="e.g. fp16,q8,q6,q4")
    quality.add_argument("--mlx-bits", type=_ints, help="mlx-lm anchors, e.g. 8,6,4")
    longctx = sub.add_parser("longctx", help="one layer to 262k tokens, plus a hybrid ingest")
    _common(longctx)
    longctx.add_argument("--contexts", type=_ints, help="e.g. 32k,64k,128k,256k")
    longctx.add_argument("--q-heads", type=_ints, help="query heads, e.g. 16,24")
    longctx.add_argument("--modes", type=_modes, help="e.g. fp16,q8,q6,q4")
    longctx.add_argument("--repeats", type=int, help="timed decode steps per contender")
    longctx.add_argument("--rotated", type=_modes_or_none,
                         help="modes also run with rotated rows, e.g. q6 ('none': skip)")
    longctx.add_argument("--hybrid-tokens", type=parse_tokens,
                         help="tokens the hybrid model reads (0: skip that part)")
    longctx.add_argument("--schedules", type=_schedules,
                         help="attention schedules of the paged cells, e.g. cpu,gpu")
    longctx.add_argument("--no-mlx", action="store_true",
                         help="the paged cells only, without mlx-lm's caches")
    pipeline = sub.add_parser("pipeline", help="tiny hybrid model: 1 process vs 2 local ranks")
    _common(pipeline)
    pipeline.add_argument("--contexts", type=_ints, help="prompt lengths, e.g. 8k,32k")
    pipeline.add_argument("--max-tokens", type=int, help="tokens generated per run")
    pipeline.add_argument("--mode", help="KV mode, e.g. fp16")
    pipeline.add_argument("--repeats", type=int, help="1-rank/2-rank pairs per context")
    pipeline.add_argument("--streams", type=_ints,
                          help="requests streamed at once through the server, e.g. 1,2,4 "
                               "(0: skip that part)")
    pipeline.add_argument("--stream-tokens", type=int, help="tokens a streamed request")
    serve = sub.add_parser("serve", help="demo model: HTTP server TTFT, resent and restarted")
    _common(serve)
    serve.add_argument("--tokens", type=parse_tokens, help="conversation tokens (about)")
    serve.add_argument("--max-tokens", type=int, help="answer tokens per request")
    serve.add_argument("--no-mlx", action="store_true", help="skip mlx_lm.server")
    serve.add_argument("--mlx-tokens", type=parse_tokens,
                       help="a shorter demo conversation for the mlx_lm.server pair")
    serve.add_argument("--hybrid-tokens", type=parse_tokens,
                       help="tiny hybrid conversation tokens (about; 0 skips it)")
    serve.add_argument("--decode-only", action="store_true",
                       help="only the server's decode rate against the CLI's, interleaved")
    spec = sub.add_parser("speculative", help="demo model: decode with and without drafts")
    _common(spec)
    spec.add_argument("--model", default="demo", help="model directory or 'demo'")
    spec.add_argument("--modes", type=_modes, help="e.g. fp16,q6")
    spec.add_argument("--document-tokens", type=parse_tokens, help="e.g. 5k")
    spec.add_argument("--max-tokens", type=int, help="tokens per answer")
    spec.add_argument("--pairs", type=int, help="off/on pairs per question")
    kernels = sub.add_parser("kernels", help="one layer's graph: Metal kernels, bytes, host time")
    _common(kernels)
    kernels.add_argument("--contexts", type=_ints, help="e.g. 32k,128k,256k")
    kernels.add_argument("--modes", type=_modes, help="e.g. fp16,q6")
    kernels.add_argument("--repeats", type=int, help="host-time repeats per decode graph")
    kernels.add_argument("--no-chunks", action="store_true", help="decode steps only")
    return parser


def run_kernels(args: argparse.Namespace, command: str) -> dict:
    from benchmarks import kernels_bench

    base = kernels_bench.QUICK if args.quick else kernels_bench.KernelsConfig()
    config = with_changes(base, contexts=args.contexts, modes=args.modes,
                          host_repeats=args.repeats, chunks=False if args.no_chunks else None)
    return _run_sections(args, command, "kernels", kernels_bench.run_kernels_bench,
                         kernels_bench.render_kernels_report, config)


def run_pipeline(args: argparse.Namespace, command: str) -> dict:
    from benchmarks import pipeline_bench

    base = pipeline_bench.QUICK if args.quick else pipeline_bench.PipelineBenchConfig()
    streams = None if args.streams is None else tuple(n for n in args.streams if n > 0)
    config = with_changes(base, contexts=args.contexts, max_tokens=args.max_tokens,
                          mode=args.mode, repeats=args.repeats, streams=streams,
                          stream_tokens=args.stream_tokens)
    return _run_sections(args, command, "pipeline", pipeline_bench.run_pipeline_bench,
                         pipeline_bench.render_pipeline_report, config)


def run_serve(args: argparse.Namespace, command: str) -> dict:
    from benchmarks import report, serve_bench

    info = report.machine_info()
    if args.decode_only:
        results = serve_bench.decode_overhead(2 if args.quick else 3,
                                              args.max_tokens or (16 if args.quick else 128))
        body = "\n".join([f"`{command}`", "", *report.machine_lines(info, report.load_average()),
                          "", serve_bench.decode_report(results)])
        report.write_section(args.output, "serve-decode", body)
        return results
    tokens = args.tokens or (1024 if args.quick else 7000)
    hybrid = args.hybrid_tokens if args.hybrid_tokens is not None else (
        2048 if args.quick else 16000)
    results = serve_bench.run(tokens, args.max_tokens or (16 if args.quick else 64),
                              mlx_lm=not args.no_mlx, hybrid_tokens=hybrid,
                              mlx_tokens=args.mlx_tokens)
    body = "\n".join([f"`{command}`", "", *report.machine_lines(info, report.load_average()),
                      "", serve_bench.report(results)])
    report.write_section(args.output, "serve", body)
    return results


def run_speculative(args: argparse.Namespace, command: str) -> dict:
    from benchmarks import speculative_bench

    base = speculative_bench.QUICK if args.quick else speculative_bench.SpeculativeConfig()
    config = with_changes(base, model=args.model, modes=args.modes,
                          document_tokens=args.document_tokens, max_tokens=args.max_tokens,
                          pairs=args.pairs)
    return _run_sections(args, command, "speculative", speculative_bench.run_speculative_bench,
                         speculative_bench.render_report, config)


def run_longctx(args: argparse.Namespace, command: str) -> dict:
    from benchmarks import longctx_bench, longctx_report, report

    quick = args.quick
    config = with_changes(
        longctx_bench.QUICK if quick else longctx_bench.LongContextConfig(),
        contexts=args.contexts, q_heads=args.q_heads, modes=args.modes,
        decode_repeats=args.repeats, rotated=args.rotated, schedules=args.schedules,
        mlx_baselines=False if args.no_mlx else None,
    )
    hybrid_config = with_changes(
        longctx_bench.HYBRID_QUICK if quick else longctx_bench.HybridIngestConfig(),
        tokens=args.hybrid_tokens,
    )
    info = report.machine_info()
    started = time.monotonic()

    def write(results: dict) -> None:
        results["wall_seconds"] = time.monotonic() - started
        body = longctx_report.render_longctx_report(results, info, command, report.load_average())
        report.write_section(args.output, "longctx", body)
        if args.json is not None:  # a run stopped early keeps its raw numbers too
            args.json.write_text(json.dumps({"machine": info, **results}, indent=1, default=str))

    results = longctx_bench.run_layer_bench(config, _progress, partial_results=write)
    if hybrid_config.tokens:
        results["hybrid"] = longctx_bench.run_hybrid_ingest(hybrid_config, _progress)
    write(results)
    return {"machine": info, **results}


def _run_sections(
    args: argparse.Namespace, command: str, name: str, run: Any, render: Any, config: Any
) -> dict:
    """Run a benchmark that rewrites its section after each step, and once at the end."""
    from benchmarks import report

    info = report.machine_info()

    def write(results: dict) -> None:
        body = render(results, info, command, report.load_average())
        report.write_section(args.output, name, body)

    results = run(config, _progress, partial_results=write)
    write(results)
    return {"machine": info, **results}


def run_cache(args: argparse.Namespace, command: str) -> dict:
    from benchmarks import cache_bench, cache_report, report

    base = cache_bench.QUICK if args.quick else cache_bench.CacheBenchConfig()
    config = with_changes(
        base,
        contexts=args.contexts,
        head_dims=args.head_dims,
        modes=args.modes,
        kv_heads=args.kv_heads,
        q_heads=args.q_heads,
        prefill_tokens=args.prefill_tokens,
        prefill_chunk=args.prefill_chunk,
        prefill_q_heads=args.prefill_q_heads,
        prefill_kv_heads=args.prefill_kv_heads,
        quant_chunk=args.quant_chunk,
        decode_repeats=args.repeats,
        decode_warmup=args.warmup,
        prefill_repeats=args.prefill_repeats,
        quant_repeats=args.quant_repeats,
        page_size=args.page_size,
    )
    info = report.machine_info()
    started = time.monotonic()
    results = cache_bench.run_cache_bench(config, progress=_progress)
    results["wall_seconds"] = time.monotonic() - started
    body = cache_report.render_cache_report(results, info, command, report.load_average())
    report.write_section(args.output, "cache", body)
    return {"machine": info, **results}


def run_generate(args: argparse.Namespace, command: str) -> dict:
    from benchmarks import generate_bench

    base = generate_bench.QUICK if args.quick else generate_bench.GenerateBenchConfig()
    config = with_changes(
        base,
        model=args.model,
        prompts=args.prompts,
        modes=args.modes,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
    )
    return _run_sections(args, command, "generate", generate_bench.run_generate_bench,
                         generate_bench.render_generate_report, config)


def run_batch(args: argparse.Namespace, command: str) -> dict:
    from benchmarks import batch_bench

    base = batch_bench.QUICK if args.quick else batch_bench.BatchBenchConfig()
    config = with_changes(
        base,
        model=args.model,
        streams=args.streams,
        prompt_tokens=args.prompt_tokens,
        mode=args.mode,
        max_tokens=args.max_tokens,
        chunk=args.chunk,
    )
    return _run_sections(args, command, "batch", batch_bench.run_batch_bench,
                         batch_bench.render_batch_report, config)


def run_agreement(args: argparse.Namespace, command: str) -> dict:
    from benchmarks import agreement_bench, report

    base = agreement_bench.QUICK if args.quick else agreement_bench.AgreementBenchConfig()
    config = with_changes(
        base, model=args.model, prompt=args.prompt, modes=args.modes, max_tokens=args.max_tokens
    )
    info = report.machine_info()
    results = agreement_bench.run_agreement_bench(config, _progress)
    body = agreement_bench.render_agreement_report(results, info, command, report.load_average())
    report.write_section(args.output, "agreement", body)
    return {"machine": info, **results}


def run_reopen(args: argparse.Namespace, command: str) -> dict:
    from benchmarks import reopen_bench

    base = reopen_bench.QUICK if args.quick else reopen_bench.ReopenBenchConfig()
    config = with_changes(
        base, model=args.model, prompts=args.prompts, mode=args.mode, max_tokens=args.max_tokens
    )
    return _run_sections(args, command, "reopen", reopen_bench.run_reopen_bench,
                         reopen_bench.render_reopen_report, config)


def run_quality(args: argparse.Namespace, command: str) -> dict:
    from benchmarks import quality_bench

    base = quality_bench.QUICK if args.quick else quality_bench.QualityBenchConfig()
    config = with_changes(
        base,
        model=args.model,
        contexts=args.contexts,
        tokens=args.tokens,
        modes=args.modes,
        mlx_bits=args.mlx_bits,
    )
    return _run_sections(args, command, "quality", quality_bench.run_quality_bench,
                         quality_bench.render_quality_report, config)


RUNNERS = {
    "cache": run_cache,
    "generate": run_generate,
    "batch": run_batch,
    "agreement": run_agreement,
    "reopen": run_reopen,
    "quality": run_quality,
    "longctx": run_longctx,
    "pipeline": run_pipeline,
    "serve": run_serve,
    "speculative": run_speculative,
    "kernels": run_kernels,
}
_STARTED = time.monotonic()


def _progress(message: str) -> None:
    elapsed = time.monotonic() - _STARTED
    print(f"[benchmarks {elapsed:7.1f}s] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    command = "python -m benchmarks " + shlex.join(argv)
    results = RUNNERS[args.command](args, command)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=str))
    _progress(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
