"""The demo behind ``make demo`` / ``python -m jmp_rewrite demo``: an application of jmp_rewrite.

It trains one small but real model twice on the same data, in the same order, from the same
initialisation: once in float32 and once with the whole jitted train step rewritten to mixed
precision by :func:`jmp_rewrite.rewrite` (float16 with dynamic loss scaling by default; on a
CPU the rewrite is forced, since TF would only pick float16 on a GPU). It then prints what the
rewrite did (:func:`jmp_rewrite.explain` of the train step), the final figures side by side,
the skipped steps and the loss-scale trajectory, and writes a plot, the HTML explain report and
the metrics as JSON to the output directory. The data set is generated procedurally
(:func:`make_dataset`), so nothing is downloaded.

It uses only jmp_rewrite's public API, plus flax, matplotlib and tqdm (``pip install
'jmp_rewrite[demo]'``). The options, the data and the reporting import without them; the
models, the training loop and :func:`run_demo` need them, and accessing those names without
them raises an ImportError that says what to install.
"""

from __future__ import annotations

import importlib
from typing import Any

from jmp_rewrite.demo.config import (
    DEPENDENCIES,
    DTYPES,
    MODELS,
    DemoConfig,
    RunResult,
    check_dependencies,
)
from jmp_rewrite.demo.data import CLASS_NAMES, make_dataset
from jmp_rewrite.demo.report import (
    comparison_table,
    half_primitives,
    plot,
    scale_events,
    trajectory_text,
    write_html,
)

# Names that need flax, and the submodule defining each; imported on first access.
_NEED_FLAX = {
    "CNN": "training",
    "MLP": "training",
    "build_steps": "training",
    "make_model": "training",
    "train": "training",
    "DemoResult": "run",
    "run_demo": "run",
}

__all__ = [
    "CLASS_NAMES",
    "DEPENDENCIES",
    "DTYPES",
    "MODELS",
    "DemoConfig",
    "RunResult",
    "check_dependencies",
    "comparison_table",
    "half_primitives",
    "make_dataset",
    "plot",
    "scale_events",
    "trajectory_text",
    "write_html",
    *_NEED_FLAX,
]


def __getattr__(name: str) -> Any:
    module = _NEED_FLAX.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    check_dependencies()
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
