"""Longleaf's MLX engine: paged, quantized KV cache, models, sessions.

This package never imports Qt; the app talks to it through plain Python
values (see ``engine.events``).
"""
