"""Whether mlx-lm can split a model folder across machines (its ``pipeline`` support).

mlx-lm splits an architecture into pipeline stages only where its model class
mixes in ``PipelineMixin`` (qwen2, qwen3_next, qwen3_5, deepseek, glm4_moe…);
llama (the demo model) and gemma have none. This reads ``config.json`` and
imports the architecture's module, never the weights.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from engine.errors import ModelLoadError
from engine.models import DEMO


def can_split(folder: str | Path) -> bool:
    """True when mlx-lm has a pipeline split for the model in ``folder`` (or "demo").

    False also for a folder that is not a model mlx-lm knows (its load says why).
    Read from mlx-lm's classes, not an instance: the load itself has the last word.
    """
    return split_refusal(folder) is None


def split_refusal(folder: str | Path) -> str | None:
    """Why the model in ``folder`` cannot be split across machines; None when it can."""
    from engine.models.demo import DEMO_ARCHITECTURE, DEMO_NAME
    from engine.models.folder import _model_classes, read_config

    if str(folder) == DEMO:
        # Known without converting it (which only the engine thread may do).
        return no_split_message(DEMO_NAME, DEMO_ARCHITECTURE)
    path = Path(folder).expanduser()
    try:
        config = read_config(path)
        model_class, _ = _model_classes(config, path)
    except ModelLoadError as error:
        return str(error)
    if _has_pipeline(model_class):
        return None
    return no_split_message(path.name, str(config["model_type"]))


def no_split_message(name: str, model_type: str) -> str:
    """What a user reads when ``name`` (of ``model_type``) cannot be split."""
    return (f"{name} cannot be split across machines: mlx-lm has no pipeline "
            f"split for its architecture ({model_type}). Use one "
            "machine, or a model mlx-lm can split (for example qwen2, qwen3_next, qwen3_5).")


def _has_pipeline(model_class: type) -> bool:
    # The mixin is on the inner model (``Model.model``, or a wrapper's
    # ``language_model.model``), a class of the module that defines the outer Model
    # or one it derives from (qwen3_5_moe's Model is qwen3_5's).
    mixin = importlib.import_module("mlx_lm.models.pipeline").PipelineMixin
    modules = {sys.modules[cls.__module__] for cls in model_class.__mro__
               if cls.__module__.startswith("mlx_lm.")}
    return any(isinstance(value, type) and issubclass(value, mixin) and value is not mixin
               for module in modules for value in vars(module).values())
