"""Human units for what the engine and the front ends tell a user."""

from __future__ import annotations


def human_bytes(n: float | None) -> str:
    """1536 -> "1.5 KB" (binary units, one decimal above bytes); None -> "—"."""
    if n is None:
        return "—"
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(value) < 1024 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TB"
