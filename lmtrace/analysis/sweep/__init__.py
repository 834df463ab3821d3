"""The sweep's analyses: which cells, what is measured, the forward that measures them, the effects.

inputs    `SweepInputs`, `sweep_inputs`: the runs, sequences, steps, cells and metrics, checked
cells     `Cell`, `build_cells`: one cell per component (and position) swept
metrics   `Metric`, `parse_metrics`, `measure`: logprob / prob / rank / kl / logit_diff from logits
engine    `Engine`: one sequence, one cell per batch row (edits, patches from a source, prefix KV reuse)
packs     `plan_sequences`, `pack_sequences`, `prepare_pack`: sequences of one layout in one forward
effects   `cell_effects`: a cell's mean effect over every (sequence, step) row — the one reduction
          behind the terminal ranking, effects.zarr, the report's heatmap and `lmtrace heads`
"""
