"""Benchmarks of the paged KV cache and the engine, as ratios against mlx-lm.

``python -m engine.bench cache`` times raw attention through the paged cache and
mlx-lm's own caches; ``python -m engine.bench generate`` times whole generations on
the demo model; ``python -m engine.bench agreement`` compares each mode's greedy
answer with fp16's at one long prompt. Each writes its tables into
``docs/benchmarks.md``.
"""
