"""Human units for what the engine and the front ends tell a user."""

from __future__ import annotations

# The one gigabyte of every size a user reads or types, in the app and on the
# command line: binary, as macOS states memory, so a budget typed as "5" is the
# "5.0 GB" the app shows for it.
GB = 2**30


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
