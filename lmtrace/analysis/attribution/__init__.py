"""Attribution of archived generated tokens to their context positions (`lmtrace explain`).

`registry` (Method, METHODS, register, parse_methods, StepContext, MethodResult), `settings`,
`targets` (the target quantity f and `Scorer`, a model as f(input embeddings)), one module per
method — `grad_x_input`, `integrated_gradients` (path, baselines, adaptive refinement),
`occlusion`, `attention_rollout`, `lrp` (its rules in `lrp_rules`) — which register themselves when imported, `replay` (an
intervention child's edits under gradients), `feature_nodes` (grad_x_input and lrp read at an SAE's latents and
error node) and `explain` (run the methods over a sequence's steps).
"""

# isort: off
# importing a method's module registers it: this order is the order `--method` lists them in
from . import grad_x_input, integrated_gradients, occlusion, attention_rollout, lrp  # noqa: F401

# isort: on
from .attention_rollout import rollout
from .explain import explain_steps, sequence_tokens
from .feature_nodes import FEATURE_METHODS, SaeAtSite, method_of, result_name, result_shortfall
from .integrated_gradients import IG_SCALE_FLOOR, IGPath, ig_shortfall
from .registry import METHODS, Method, MethodResult, StepContext, parse_methods, register
from .replay import NOT_REPLAYABLE, REPLAY_TOLERANCE, ContextEdits, child_edits, unreplayable_edit
from .settings import Settings
from .targets import Scorer, target_values

__all__ = [
    "FEATURE_METHODS",
    "IG_SCALE_FLOOR",
    "METHODS",
    "NOT_REPLAYABLE",
    "REPLAY_TOLERANCE",
    "ContextEdits",
    "IGPath",
    "Method",
    "SaeAtSite",
    "MethodResult",
    "Scorer",
    "Settings",
    "StepContext",
    "child_edits",
    "explain_steps",
    "ig_shortfall",
    "method_of",
    "parse_methods",
    "register",
    "result_name",
    "result_shortfall",
    "rollout",
    "sequence_tokens",
    "target_values",
    "unreplayable_edit",
]
