"""Attribution of archived generated tokens to their context positions (`lmtrace explain`).

`registry` (Method, METHODS, register, parse_methods, StepContext, MethodResult), `settings`,
`targets` (the target quantity f and `Scorer`, a model as f(input embeddings)), one module per
method — `grad_x_input`, `integrated_gradients` (path, baselines, adaptive refinement),
`occlusion`, `attention_rollout` — which register themselves when imported, `replay` (an
intervention child's edits under gradients) and `explain` (run the methods over a sequence's steps).
"""

from .registry import METHODS, Method, MethodResult, StepContext, parse_methods, register
from .settings import Settings
from .targets import Scorer, target_values
from .replay import NOT_REPLAYABLE, REPLAY_TOLERANCE, ContextEdits, child_edits, unreplayable_edit

# importing a method's module registers it; this order is the order `--method` lists them in
from . import grad_x_input, integrated_gradients, occlusion, attention_rollout  # noqa: E402,F401  isort: skip
from .attention_rollout import rollout  # noqa: E402
from .integrated_gradients import IG_SCALE_FLOOR, IGPath, ig_shortfall  # noqa: E402
from .explain import explain_steps, sequence_tokens  # noqa: E402

__all__ = ["METHODS", "Method", "MethodResult", "StepContext", "parse_methods", "register", "Settings", "Scorer",
           "target_values", "NOT_REPLAYABLE", "REPLAY_TOLERANCE", "ContextEdits", "child_edits", "unreplayable_edit",
           "rollout", "IG_SCALE_FLOOR", "IGPath", "ig_shortfall", "explain_steps", "sequence_tokens"]
