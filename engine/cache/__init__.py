"""The KV cache's bottom layer: storage format, pages, attention, the mlx-lm adapter.

It imports nothing from the rest of the engine except ``engine.errors``
(``tests/test_layering.py``).
"""
