"""Interventions as data: typed entries (where + when), validated against a model, installed as hooks.

Edits of a module's input are torch forward pre-hooks; edits of its output are taps
(`lmtrace/capture/taps.py`) added first, so the probes' taps on the same module record the edited
output. Edits of a head, a neuron, a block's output or the residual stream go through
`lmtrace/capture/component_hooks.py`, the hooks the sweep's patches use too.

Every kind edits the real forward pass; nothing perturbs logits after the fact. An edit active at
step s applies to the positions the forward computes at that step (all prompt positions at the
prefill, the query position afterwards); K/V cached at earlier steps keep the values they had.

Kinds (registry `KINDS`, each writable in YAML and stored in the child's manifest):
  ablate_head       the head's slice of the output projection's input set to 0 or to its mean
  ablate_attention  the attention block's output set to 0 or to its mean
  ablate_mlp        the MLP block's output set to 0 or to its mean
  ablate_neurons    chosen neurons of the MLP intermediate activation set to 0 or to their mean
  ablate_layer      skip the layer (its output is its input), or add its mean residual contribution
  mask_positions    hide token positions (or a prompt / generated / chat system / chat user span) from
                    every query through the attention mask
  patch_residual    replace the residual after a layer at the query position with another run's archived vector
  patch_head        replace one head's slice of the output projection's input at the query position with
                    that head's value in another run at the same step (teacher-forced replay of that run)
  steer             add alpha * v to the residual after a layer
  mask_experts      remove experts from a MoE router's choice (their router logits -inf before the
                    family's own top-k and normalisation)
  ablate_feature    an SAE latent set to 0 at the SAE's hook, the SAE's reconstruction error kept
  clamp_feature     an SAE latent set to a value there (x' = x + decode(f') - decode(f))
  steer_feature     the latent's decoder direction times a coefficient added there

Mean values (`mode: mean`) are the component's mean over every token position of every final
sequence (prompt + generated tokens) of the parent, each run alone in one teacher-forced forward of
the unedited model (`component_means`).

Modules, one job each:
  entries     the entry kinds (pydantic), `parse_entries`, `validate_against` a model and a run
  shorthand   the command line's shorthand flags turned into entries
  edits       `EditSet`: the hooks in the forward pass (through `capture/component_hooks.py`)
  means       the mean values of `mode: mean` ablations
  routing     the MoE routing rules `mask_experts` re-applies
  sources     steering vectors and patch_residual values read from other runs
  feature_saes  the SAEs of feature edits: resolved, read, checked, recorded in the entry
"""

from .edits import EditSet
from .entries import (
    CHAT_SPANS,
    KINDS,
    SPANS,
    AblateAttention,
    AblateFeature,
    AblateHead,
    AblateLayer,
    AblateMlp,
    AblateNeurons,
    Ablation,
    ClampFeature,
    Entry,
    EntryBase,
    FeatureEntry,
    MaskExperts,
    MaskPositions,
    PatchHead,
    PatchResidual,
    Steer,
    SteerFeature,
    parse_entries,
    validate_against,
)
from .feature_saes import check_edit_sites, load_edit_saes
from .means import MEAN_COMPONENT, component_means, mean_ablation_values
from .routing import ROUTING_RULES, routing_rule
from .shorthand import parse_range_list, shorthand_entries
from .sources import load_steer_vector, patch_source

__all__ = [
    "CHAT_SPANS",
    "KINDS",
    "MEAN_COMPONENT",
    "ROUTING_RULES",
    "SPANS",
    "Ablation",
    "AblateAttention",
    "AblateFeature",
    "AblateHead",
    "AblateLayer",
    "AblateMlp",
    "AblateNeurons",
    "ClampFeature",
    "EditSet",
    "Entry",
    "EntryBase",
    "FeatureEntry",
    "MaskExperts",
    "MaskPositions",
    "PatchHead",
    "PatchResidual",
    "Steer",
    "SteerFeature",
    "check_edit_sites",
    "component_means",
    "load_edit_saes",
    "load_steer_vector",
    "mean_ablation_values",
    "parse_entries",
    "parse_range_list",
    "patch_source",
    "routing_rule",
    "shorthand_entries",
    "validate_against",
]
