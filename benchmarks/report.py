"""Machine facts and the Markdown tables that ``benchmarks`` writes to docs/benchmark-runs.md.

Each benchmark owns one marked section of the file (``<!-- bench:NAME:start -->`` to
``<!-- bench:NAME:end -->``); rewriting it leaves the rest of the file alone, so the
cache and generate benchmarks (and hand-written notes) can live side by side.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

MIB = 1024 * 1024
DOC_TITLE = """# Benchmarks

Numbers written by `python -m benchmarks` (each command rewrites only its own section).
Run on Linux with OpenBLAS preloaded, and read the load average each section records:

    source scripts/env.sh
    .venv/bin/python -m benchmarks cache        # 10 min on 2 cores at load ~2.5; --quick: ~2 min
    .venv/bin/python -m benchmarks generate     # demo model, 1k/4k/7k prompts
    .venv/bin/python -m benchmarks agreement    # demo model, each mode vs fp16 at 6k
"""


def cpu_model() -> str:
    """The CPU's marketing name, as the OS reports it."""
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True
            )
            return out.stdout.strip() or platform.processor()
        except OSError:
            return platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_in_use() -> str:
    """Which BLAS the MLX CPU backend uses in this process, read from the loaded libraries."""
    if platform.system() == "Darwin":
        return "Accelerate (macOS)"
    preload = os.environ.get("LD_PRELOAD", "")
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    libraries = set(re.findall(r"/\S*openblas\S*\.so[\w.]*", maps))
    system = sorted(lib for lib in libraries if "site-packages" not in lib)
    if system and "openblas" in preload:
        return (
            f"OpenBLAS, preloaded ahead of the mlx[cpu] wheel's reference BLAS "
            f"(LD_PRELOAD={preload}; loaded: {', '.join(Path(lib).name for lib in system)})"
        )
    return (
        "the mlx[cpu] wheel's bundled reference BLAS (no OpenBLAS loaded; "
        f"LD_PRELOAD={preload or 'unset'})"
    )


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict[str, Any]:
    """Plain facts about the machine and software a benchmark ran on."""
    import mlx.core as mx

    try:
        import psutil

        memory = f"{psutil.virtual_memory().total / 2**30:.1f} GiB"
    except ImportError:
        memory = "unknown"
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cores": f"{usable} usable of {os.cpu_count()}",
        "memory": memory,
        "os": platform.platform(),
        "python": platform.python_version(),
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "device": str(mx.default_device()),
        "blas": blas_in_use(),
        "load_average": load_average(),
    }


def load_average() -> str:
    """The 1/5/15-minute load averages, or 'unknown' where the OS has none."""
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def machine_lines(info: dict[str, Any], load_after: str | None = None) -> list[str]:
    """Markdown bullet lines describing the machine a run used."""
    lines = [
        f"- Date: {info['date']}",
        f"- CPU: {info['cpu']} ({info['cores']} cores), {info['memory']} RAM",
        f"- OS: {info['os']}, Python {info['python']}",
        f"- mlx {info['mlx']} (device {info['device']}), mlx-lm {info['mlx_lm']}",
        f"- BLAS: {info['blas']}",
        f"- Load average (1/5/15 min) at start: {info['load_average']}",
    ]
    if load_after is not None:
        lines.append(f"- Load average at end: {load_after}")
    return lines


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or zero."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def fmt_ratio(value: float | None, goal: float | None = None) -> str:
    """A ratio like ``0.93×``, marked ✅/❌ against ``goal`` (an upper bound) if given."""
    if value is None:
        return "n/a"
    text = f"{value:.2f}×"
    if goal is not None:
        text += " ✅" if value <= goal else " ❌"
    return text


def fmt_tokens(count: int) -> str:
    """A token count as ``4k`` where it is a whole number of 1024s."""
    return f"{count // 1024}k" if count % 1024 == 0 else str(count)


def fmt_bytes(value: float | None) -> str:
    """Bytes as MiB with one decimal."""
    return "n/a" if value is None else f"{value / MIB:.1f} MiB"


def section_markers(name: str) -> tuple[str, str]:
    """The comment lines that delimit a benchmark's section."""
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


def write_section(path: Path, name: str, body: str) -> None:
    """Replace (or append) section ``name`` of the Markdown file at ``path``."""
    start, end = section_markers(name)
    block = f"{start}\n{body.rstrip()}\n{end}\n"
    text = path.read_text() if path.exists() else DOC_TITLE
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end) + r"\n?", re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip() + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


class GoalTally:
    """Collects pass/fail per goal over every measured cell."""

    def __init__(self) -> None:
        self.cells: dict[str, list[tuple[str, float | None, bool | None]]] = {}

    def check(self, goal: str, where: str, value: float | None, limit: float) -> None:
        met = None if value is None else value <= limit
        self.cells.setdefault(goal, []).append((where, value, met))

    def lines(self) -> list[str]:
        rows = []
        for goal, cells in self.cells.items():
            # A cell has a verdict exactly when it has a value (check()).
            measured = [(w, v, m) for w, v, m in cells if v is not None and m is not None]
            failed = [c for c in measured if not c[2]]
            worst = max((c[1] for c in measured), default=None)
            verdict = "met" if measured and not failed else "NOT met" if failed else "not measured"
            missed = ", ".join(f"{w} ({v:.2f})" for w, v, _ in failed[:12])
            if len(failed) > 12:
                missed += f", … {len(failed) - 12} more"
            rows.append(
                (
                    goal,
                    f"**{verdict}**",
                    f"{len(measured) - len(failed)}/{len(measured)}",
                    "n/a" if worst is None else f"{worst:.2f}",
                    missed or "—",
                )
            )
        return table(("goal", "verdict", "cells met", "worst", "cells that miss"), rows)
