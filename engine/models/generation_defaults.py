"""A model's own sampling defaults, from its folder's ``generation_config.json``.

Model makers publish the temperature, top_p, top_k, min_p and repetition
penalty their model answers best with; the app uses them for every key the
user has not set in Settings. A value out of range, a missing or unreadable
file give no default for that key (never an error: the model loads anyway).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import TypeGuard

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
# Each key the app takes, with the range ``SamplingParams`` accepts for it.
VALID: dict[str, Callable[[float], bool]] = {
    "temperature": lambda v: v >= 0,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: v >= 0 and float(v).is_integer(),
    "min_p": lambda v: 0 <= v < 1,
    "repetition_penalty": lambda v: v > 0,
}


def generation_defaults(folder: str | Path) -> dict[str, float | int]:
    """The sampling values ``folder``'s generation config sets, by ``SamplingParams`` key.

    ``"do_sample": false`` means greedy decoding to transformers, whatever
    temperature the file also names: it gives temperature 0.
    """
    path = Path(folder) / GENERATION_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8-sig"))  # editors may add a BOM
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        log.warning("%s could not be read (%s); the app's sampling defaults apply", path, error)
        return {}
    if not isinstance(config, dict):
        return {}
    found: dict[str, float | int] = {}
    for key, valid in VALID.items():
        value = config.get(key)
        # json reads NaN and Infinity too: neither is a setting (SamplingParams refuses them).
        if _finite(value) and valid(value):
            found[key] = int(value) if key == "top_k" else float(value)
    if config.get("do_sample") is False:
        found["temperature"] = 0.0
    return found


def _finite(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is a finite number: json reads NaN and Infinity, and integers
    past a float's range (SamplingParams refuses all three)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
