"""Benchmarks of the paged KV cache and the engine, as ratios against mlx-lm.

``python -m benchmarks cache`` times raw attention through the paged cache and
mlx-lm's own caches; ``python -m benchmarks generate`` times whole generations on
the demo model; ``python -m benchmarks agreement`` compares each mode's greedy
answer with fp16's at one long prompt. Each writes its tables into
``docs/benchmark-runs.md`` (the run log); ``docs/benchmarks.md`` keeps the current
verdict per goal.

Not part of the product: neither the wheel nor the app holds this package. Run it
from the checkout's root, where it is importable.
"""
