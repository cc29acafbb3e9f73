"""Benchmarks of the paged KV cache and the engine, as ratios against mlx-lm.

``python -m engine.bench cache`` times raw attention through the paged cache and
mlx-lm's own caches; ``python -m engine.bench generate`` times whole generations on
the demo model. Both write their tables into ``docs/benchmarks.md``.
"""
