"""The generation loop and what it captures, all in memory, knowing nothing of files.

`tracer` runs the KV-cached loop (`kv_cache`, `sampling`) over a model reached through `arch`'s
adapters; `taps` hooks the modules; `attention` / `attention_rows` recompute attention rows from the
captured queries and cached keys; `probes` turn one step's taps into the archived per-step arrays;
`lens` is the logit lens; `interventions` are the edits applied inside the loop."""
