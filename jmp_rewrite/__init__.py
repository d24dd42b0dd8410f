"""jmp_rewrite: TensorFlow's automatic mixed precision for JAX.

Public names only; the implementation lives in ``jmp_rewrite._src``, which is private.
"""

#: The release, the one place it is written: the package's metadata (pyproject.toml reads it
#: from here) and the documentation site show it.
__version__ = "0.1.0"

from jmp_rewrite._src.emit.facts import EquationPaint as EquationPaint
from jmp_rewrite._src.emit.facts import PaintResult as PaintResult
from jmp_rewrite._src.explain.build import CastReport as CastReport
from jmp_rewrite._src.explain.build import EquationReport as EquationReport
from jmp_rewrite._src.explain.build import Report as Report
from jmp_rewrite._src.explain.build import explain as explain
from jmp_rewrite._src.fp8 import Fp8Rules as Fp8Rules
from jmp_rewrite._src.lists.environment import lists_from_environment as lists_from_environment
from jmp_rewrite._src.lists.op_lists import LEVELS as LEVELS
from jmp_rewrite._src.lists.op_lists import OpLists as OpLists
from jmp_rewrite._src.lists.op_lists import default_lists as default_lists
from jmp_rewrite._src.lists.op_lists import known_op_keys as known_op_keys
from jmp_rewrite._src.rewrite import paint_program as paint
from jmp_rewrite._src.rewrite import rewrite as rewrite
from jmp_rewrite._src.rewrite import rewrite_jaxpr as rewrite_jaxpr
from jmp_rewrite._src.seed import (
    disable_mixed_precision_graph_rewrite as disable_mixed_precision_graph_rewrite,
)
from jmp_rewrite._src.seed import (
    enable_mixed_precision_graph_rewrite as enable_mixed_precision_graph_rewrite,
)
from jmp_rewrite._src.seed import (
    mixed_precision_graph_rewrite_enabled as mixed_precision_graph_rewrite_enabled,
)
from jmp_rewrite._src.settings import Fp8NoneSelectedWarning as Fp8NoneSelectedWarning
from jmp_rewrite._src.settings import RewriteOffWarning as RewriteOffWarning
from jmp_rewrite._src.settings import platform_dtype as platform_dtype
from jmp_rewrite._src.trace.regions import float32_region as float32_region

__all__ = (
    "LEVELS",
    "CastReport",
    "EquationReport",
    "Report",
    "explain",
    "EquationPaint",
    "Fp8NoneSelectedWarning",
    "Fp8Rules",
    "OpLists",
    "PaintResult",
    "RewriteOffWarning",
    "default_lists",
    "disable_mixed_precision_graph_rewrite",
    "enable_mixed_precision_graph_rewrite",
    "float32_region",
    "known_op_keys",
    "lists_from_environment",
    "mixed_precision_graph_rewrite_enabled",
    "paint",
    "platform_dtype",
    "rewrite",
    "rewrite_jaxpr",
)

# --- loss scaling (begin) ---
# Placed after ``__all__`` is first defined so that ``__all__ +=`` below works.
from jmp_rewrite._src.loss_scale.optimizer import (  # noqa: E402
    LossScaleDebugState,
    LossScaleOptimizerState,
    MixedPrecisionLossScaleOptimizer,
    UnscaledGradientsWarning,
    all_finite,
    get_loss_scale,
    get_loss_scale_state,
    is_loss_scale_optimizer,
    last_step_applied,
    loss_scale_optimizer,
    non_finite_leaves,
    scale_loss,
    value_and_grad,
)
from jmp_rewrite._src.loss_scale.scale import (  # noqa: E402
    DynamicLossScale,
    FixedLossScale,
)

__all__ += (
    "DynamicLossScale",
    "FixedLossScale",
    "LossScaleDebugState",
    "LossScaleOptimizerState",
    "MixedPrecisionLossScaleOptimizer",
    "UnscaledGradientsWarning",
    "all_finite",
    "get_loss_scale",
    "get_loss_scale_state",
    "is_loss_scale_optimizer",
    "last_step_applied",
    "loss_scale_optimizer",
    "non_finite_leaves",
    "scale_loss",
    "value_and_grad",
)
# --- loss scaling (end) ---

# --- compare (begin) ---
from jmp_rewrite._src.compare.comparison import Comparison  # noqa: E402
from jmp_rewrite._src.compare.run import compare  # noqa: E402
from jmp_rewrite._src.compare.suggest import Suggestion  # noqa: E402

__all__ += ("Comparison", "Suggestion", "compare")
# --- compare (end) ---
