"""Every name, dimension and dtype of the run archive, in one place (documented in docs/archive.md).

Array names follow one scheme and are used unchanged by probes, writer, reader and docs:

  per step, leading dims (sequence, step):
    attn           [sequence, step, layer, q_head, key]        post-softmax query row, key = token position
    attn_topk_idx  [sequence, step, layer, q_head, k_attn]     (attention.top_k set) key positions, -1 = none
    attn_topk_prob [sequence, step, layer, q_head, k_attn]
    q              [sequence, step, layer, q_head, head_dim]   post-rotary query of the query position
    k, v           [sequence, step, layer, kv_head, head_dim] post-rotary key / value of the query position
    ffn_idx        [sequence, step, layer, k_ffn]            top-|a| neurons of the MLP intermediate activation
    ffn_val        [sequence, step, layer, k_ffn]            their signed values
    resid          [sequence, step, resid_layer, d_model]    residual stream after the layer (full vectors)
    lens_ids       [sequence, step, layer, k_lens]           logit-lens top-k token ids
    lens_probs     [sequence, step, layer, k_lens]           and their probabilities
    router_topk_idx    [sequence, step, layer, k_router]     (mixture-of-experts models) experts the router chose, -1 = dense layer
    router_topk_weight [sequence, step, layer, k_router]     the weight the MoE block gives each chosen expert
    head_dla       [sequence, step, layer, q_head]           (capture.head_dla) direct logit attribution of each
                                                             query head to logit(chosen) − logit(runner-up)
    attn_dla, mlp_dla [sequence, step, layer]                of each layer's attention / MLP output
    embed_dla, bias_dla, rest_dla [sequence, step]           embedding; constant (norm / unembedding biases); rest
    *_dla_logit    the same six, attributing logit(chosen)
    dla_runner_up  [sequence, step]                          the runner-up token id
    feat_<sae>_idx [sequence, step, k_feat]                  (capture.features) the SAE's most active latents
                                                             at the token, largest first, -1 = fewer active
    feat_<sae>_val [sequence, step, k_feat]                  their activations (NaN where idx is -1)
  prompt time:
    prefill_attn   [sequence, layer, q_head, query_pos, key_pos]
    prompt_k, prompt_v [sequence, layer, kv_head, prompt_pos, head_dim]
    prompt_feat_<sae>_idx, prompt_feat_<sae>_val [sequence, prompt_pos, k_feat]   (capture.features prompt: true)
  coordinates and per-sequence:
    layer [layer], resid_layer [resid_layer], q_head [q_head], kv_head [kv_head], key, prompt_pos, query_pos, key_pos (positions),
    kv_head_of_head [q_head], prompt_len [sequence], generated_len [sequence]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# 2: the query-head dimension is `q_head` (was `head`, which hides xarray's Dataset.head()), and
# the position dimensions (key, prompt_pos, query_pos, key_pos) carry coordinates. Readers take both.
# 3: arrays over `sequence` are sharded (one file per `output.chunk_sequences` sequences × block of
# steps, archive/shards.py); the capture presets store `resid` as float16. Zarr reads all three alike.
# 4: every chunk of every array ends in its crc32c (zarr's `crc32c` codec, inside the shards too) and
# every Parquet page carries its CRC32, so a read of damaged bytes fails (docs/archive.md, "Checksums").
FORMAT_VERSION = 4
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4)

MANIFEST = "manifest.json"
SPEC = "spec.yaml"
TENSORS = "tensors.zarr"
LOG = "log.jsonl"
PROGRESS_DIR = "progress"  # one JSON file per writer (shard): committed steps per batch
SHARDS_DIR = "shards"  # one JSON status file per shard
LOCK = ".lock"  # short flocks around manifest and array creation, finalisation, the lens
OWNERS_DIR = "owners"  # owners/<writer>.lock: flocked by the writer of that key for its whole life
TABLES = ("tokens", "steps", "sequences")
# The tokenizer's vocabulary, so that ids (alt_ids, lens_ids, lens_top1, effects' *_top1...) read
# as text without the model: one row per id 0 .. len(tokenizer) - 1, written once per run
VOCAB = "vocab.parquet"
# An intervention child's effects (`lmtrace intervene`): one row per sequence and child step, written
# when the child completes; archive/effects.py reads it
EFFECTS = "effects.parquet"


def table_file(name: str) -> str:
    return f"{name}.parquet"


def batch_part_name(batch: int) -> str:
    """Batches are named by their first sequence index, unique across the shards of a run."""
    return f"b{batch:06d}"


def block_part_name(batch: int, s0: int) -> str:
    return f"{batch_part_name(batch)}-s{s0:08d}"


def part_batch(filename: str) -> int:
    """The batch of a block or sequences part file (`b<batch>[-s<step>].parquet`)."""
    return int(filename.split(".")[0].split("-")[0].lstrip("b"))


def part_start_step(filename: str) -> int | None:
    stem = filename.split(".")[0].lstrip(".")
    if "-s" not in stem:
        return None
    return int(stem.split("-s")[1])


def table_parts_dir(name: str) -> str:
    """Where a table's part files live while a run is being written (compacted at completion)."""
    return f"{name}.parts"


@dataclass(frozen=True)
class ArraySpec:
    name: str
    dims: tuple[str, ...]
    dtype: str
    per_step: bool  # leading dims (sequence, step) and written in step blocks
    # What `codec: auto` uses for this array (docs/archive.md, "Compression"): zstd where it pays
    # (ids, lens arrays, attention rows, float16 residuals); "none" for dense float activations (q/k/v,
    # float32 residual vectors, FFN values), which zstd shrinks by only ~7 % for ~0.4 ms of CPU a step
    auto_codec: str = "zstd"

    @property
    def key_chunked(self) -> bool:
        """Per-step rows over token positions (attention): also chunked along `key`, and written
        only as far as a block's context reaches (`block_keys`)."""
        return self.per_step and self.dims[-1] == "key"

    @property
    def fill(self):
        return np.nan if np.dtype(self.dtype).kind == "f" else -1


def key_chunk_width(chunk_keys: int | None, max_len: int) -> int:
    """Keys per chunk of a `key_chunked` array of `max_len` keys (`output.chunk_keys`; None: all)."""
    return min(chunk_keys, max_len) if chunk_keys else max_len


def block_keys(padded_prompt: int, s0: int, chunk_steps: int, key_chunk: int, max_len: int) -> int:
    """Keys a block of steps [s0, s0 + chunk_steps) holds of a `key_chunked` array: up to the last
    key its context reaches (the padded prompt, then one key per step), rounded up to whole key
    chunks, at most `max_len`. The chunks past it are never written."""
    reached = padded_prompt + s0 + chunk_steps - 1
    return min(max_len, -(-reached // key_chunk) * key_chunk)


# written during generation with an inline lens, or later by `lmtrace lens` (lmtrace/commands/lens.py)
LENS_ARRAYS = (
    ArraySpec("lens_ids", ("sequence", "step", "layer", "k_lens"), "int32", True),
    ArraySpec("lens_probs", ("sequence", "step", "layer", "k_lens"), "float32", True),
)
LENS_STEP_COLUMNS = (
    "lens_top1",
    "lens_top1_prob",
    "lens_margin",
    # the chosen token's and the runner-up's lens rank and probability, and the first
    # captured layer from which the chosen token stays the lens's top-1 (per step,
    # repeated on its layers' rows)
    "lens_target_rank",
    "lens_target_prob",
    "lens_runner_up_rank",
    "lens_runner_up_prob",
    "settle_layer",
)


# Direct logit attribution (lmtrace/capture/dla.py, docs/archive.md): per target, heads [layer, q_head],
# blocks [layer] and the per-step terms, which sum to the model's final logit (difference)
DLA_TERMS = ("embed_dla", "bias_dla", "rest_dla")


def dla_arrays() -> list[ArraySpec]:
    out = []
    for suffix in ("", "_logit"):
        out.append(
            ArraySpec(f"head_dla{suffix}", ("sequence", "step", "layer", "q_head"), "float32", True, auto_codec="none")
        )
        out += [
            ArraySpec(f"{part}_dla{suffix}", ("sequence", "step", "layer"), "float32", True, auto_codec="none")
            for part in ("attn", "mlp")
        ]
        out += [
            ArraySpec(f"{term}{suffix}", ("sequence", "step"), "float32", True, auto_codec="none") for term in DLA_TERMS
        ]
    out.append(ArraySpec("dla_runner_up", ("sequence", "step"), "int32", True))
    return out


@dataclass(frozen=True)
class FeatureShape:
    """One SAE's arrays (capture.features): `name` is the run's short name for it (its directory's
    name, made unique), `top_k` the latents kept per token, `prompt` whether prompt positions are too."""

    name: str
    top_k: int
    prompt: bool = False


def feature_arrays(f: FeatureShape) -> list[ArraySpec]:
    """feat_<name>_idx / _val over (sequence, step, k_feat), and the prompt's over prompt_pos."""
    out = [
        ArraySpec(f"feat_{f.name}_idx", ("sequence", "step", "k_feat"), "int32", True),
        ArraySpec(f"feat_{f.name}_val", ("sequence", "step", "k_feat"), "float32", True),
    ]
    if f.prompt:
        out += [
            ArraySpec(f"prompt_feat_{f.name}_idx", ("sequence", "prompt_pos", "k_feat"), "int32", False),
            ArraySpec(f"prompt_feat_{f.name}_val", ("sequence", "prompt_pos", "k_feat"), "float32", False),
        ]
    return out


@dataclass(frozen=True)
class RunShape:
    """The sizes that fix every array's shape for one run."""

    n_sequences: int
    n_steps: int  # max_new_tokens: step 0 is the prefill
    max_prompt: int
    layers: tuple[int, ...]  # captured layer indices
    resid_layers: tuple[int, ...]
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_model: int
    d_ffn: int
    kv_head_of_head: tuple[int, ...]
    k_attn: int | None = None  # None = full rows
    k_ffn: int = 32
    k_lens: int = 5
    attention: bool = True
    prefill_attention: bool = False
    qkv: bool = True
    ffn: bool = True
    lens: bool = True
    float_dtype: str = "float16"
    resid_dtype: str = "float32"  # capture.residual.dtype: storage dtype of `resid`
    k_router: int = 0  # experts per token of a mixture-of-experts model (0: dense, no router arrays)
    head_dla: bool = False  # direct logit attribution arrays (dla_arrays())
    features: tuple[FeatureShape, ...] = ()  # capture.features: one SAE's arrays each (feature_arrays())
    extra: dict = field(default_factory=dict)

    @property
    def max_len(self) -> int:
        return self.max_prompt + self.n_steps

    @property
    def k_feat(self) -> int:
        """The width of every SAE's feature arrays: the largest top_k asked for (an SAE that keeps
        fewer fills the rest with -1 / NaN)."""
        return max((f.top_k for f in self.features), default=0)

    def dim_sizes(self) -> dict[str, int]:
        return {
            "sequence": self.n_sequences,
            "step": self.n_steps,
            "layer": len(self.layers),
            "resid_layer": len(self.resid_layers),
            "q_head": self.n_heads,
            "kv_head": self.n_kv_heads,
            "key": self.max_len,
            "k_attn": self.k_attn or 0,
            "head_dim": self.head_dim,
            "d_model": self.d_model,
            "k_ffn": self.k_ffn,
            "k_lens": self.k_lens,
            "k_router": self.k_router,
            "k_feat": self.k_feat,
            "query_pos": self.max_prompt,
            "key_pos": self.max_prompt,
            "prompt_pos": self.max_prompt,
        }

    def arrays(self) -> list[ArraySpec]:
        f = self.float_dtype
        out: list[ArraySpec] = []
        if self.attention and self.k_attn is None:
            # zstd: 1.5x on the rows at short contexts (their key-chunk fill included) for ~0.08 ms a token,
            # against 1.3x for Blosc-LZ4 (docs/archive.md, "Compression")
            out.append(ArraySpec("attn", ("sequence", "step", "layer", "q_head", "key"), f, True))
        if self.attention and self.k_attn is not None:
            out.append(ArraySpec("attn_topk_idx", ("sequence", "step", "layer", "q_head", "k_attn"), "int32", True))
            out.append(ArraySpec("attn_topk_prob", ("sequence", "step", "layer", "q_head", "k_attn"), f, True))
        if self.qkv:
            out.append(ArraySpec("q", ("sequence", "step", "layer", "q_head", "head_dim"), f, True, auto_codec="none"))
            out.append(ArraySpec("k", ("sequence", "step", "layer", "kv_head", "head_dim"), f, True, auto_codec="none"))
            out.append(ArraySpec("v", ("sequence", "step", "layer", "kv_head", "head_dim"), f, True, auto_codec="none"))
            out.append(
                ArraySpec(
                    "prompt_k", ("sequence", "layer", "kv_head", "prompt_pos", "head_dim"), f, False, auto_codec="none"
                )
            )
            out.append(
                ArraySpec(
                    "prompt_v", ("sequence", "layer", "kv_head", "prompt_pos", "head_dim"), f, False, auto_codec="none"
                )
            )
        if self.ffn:
            out.append(ArraySpec("ffn_idx", ("sequence", "step", "layer", "k_ffn"), "int32", True))
            out.append(ArraySpec("ffn_val", ("sequence", "step", "layer", "k_ffn"), "float32", True, auto_codec="none"))
        if self.resid_layers:
            # float16 vectors: zstd keeps 0.89x of them (mostly the fill of blocks past a sequence's end)
            # for ~0.04 ms a token; float32 ones stay raw (1.07x for ~0.2 ms a step)
            out.append(
                ArraySpec(
                    "resid",
                    ("sequence", "step", "resid_layer", "d_model"),
                    self.resid_dtype,
                    True,
                    auto_codec="zstd" if self.resid_dtype == "float16" else "none",
                )
            )
        if self.lens:
            out.extend(LENS_ARRAYS)
        if self.k_router and self.layers:
            out.append(ArraySpec("router_topk_idx", ("sequence", "step", "layer", "k_router"), "int32", True))
            out.append(ArraySpec("router_topk_weight", ("sequence", "step", "layer", "k_router"), "float32", True))
        if self.head_dla and self.layers:
            out.extend(dla_arrays())
        for f in self.features:
            out.extend(feature_arrays(f))
        if self.prefill_attention:
            out.append(ArraySpec("prefill_attn", ("sequence", "layer", "q_head", "query_pos", "key_pos"), f, False))
        return out

    def shape_of(self, spec: ArraySpec) -> tuple[int, ...]:
        sizes = self.dim_sizes()
        return tuple(sizes[d] for d in spec.dims)

    def written_keys_per_step(self, chunk_steps: int, chunk_keys: int | None) -> float:
        """Keys per step that arrays over `key` (attention rows) write, averaged over the run.

        A block of `chunk_steps` steps writes whole key chunks up to the last key its context
        reaches (`block_keys`, as archive.sink.BlockSink buffers them), each holding `chunk_steps`
        steps, also in a partial last block. Without key chunks: every key.
        These are the key columns stored, so chunk padding is counted.
        """
        if not chunk_keys or self.n_steps == 0:
            return float(self.max_len)
        k = key_chunk_width(chunk_keys, self.max_len)  # as writer.create_array chunks the array
        written = 0  # in whole chunks: the last one is stored whole, also past max_len
        for s0 in range(0, self.n_steps, chunk_steps):
            written += -(-block_keys(self.max_prompt, s0, chunk_steps, k, self.max_len) // k) * k * chunk_steps
        return written / self.n_steps

    def estimate_bytes_per_step(self, chunk_steps: int = 1, chunk_keys: int | None = None) -> int:
        """Uncompressed bytes one sequence adds per generated step: an upper bound, since rows are
        sized for the longest prompt of the run and other padding is counted too."""
        sizes = self.dim_sizes()
        total = 0.0
        for spec in self.arrays():
            if spec.per_step:
                n = float(np.prod([sizes[d] for d in spec.dims[2:]]))
                if spec.key_chunked:
                    n = n / sizes["key"] * self.written_keys_per_step(chunk_steps, chunk_keys)
                total += n * np.dtype(spec.dtype).itemsize
        return int(round(total))


# Per-layer scalars in steps.parquet (one row per sequence, step, captured layer).
STEP_COLUMNS = (
    "sequence",
    "step",
    "layer",
    "resid_norm",
    "delta_norm",
    "attn_norm",
    "mlp_norm",
    "lens_top1",
    "lens_top1_prob",
    "lens_margin",
    "lens_target_rank",
    "lens_target_prob",
    "lens_runner_up_rank",
    "lens_runner_up_prob",
    "settle_layer",
    "margin_contrib",
)


def with_pandas_types(schema, always_present: tuple[str, ...]):
    """Attach pandas metadata so that `pandas.read_parquet` reads the documented types.

    Without it pandas turns an int32 column holding nulls into float64 and a bool column into
    object. Every integer and boolean column not in `always_present` is marked as pandas'
    nullable `Int32` / `Int64` / `boolean`; the others read as numpy int32 / bool as before."""
    import json

    import pyarrow as pa

    columns = []
    for f in schema:
        if f.name in always_present:
            continue
        if pa.types.is_boolean(f.type):
            columns.append((f.name, "bool", "boolean"))
        elif pa.types.is_integer(f.type):
            bits = f.type.bit_width
            columns.append((f.name, f"int{bits}", f"Int{bits}"))
    meta = {
        "index_columns": [],
        "column_indexes": [],
        "creator": {"library": "lmtrace"},
        "columns": [
            {"name": n, "field_name": n, "pandas_type": pt, "numpy_type": nt, "metadata": None} for n, pt, nt in columns
        ],
    }
    return schema.with_metadata({b"pandas": json.dumps(meta).encode()})


def token_schema():
    """tokens.parquet: one row per token of every sequence (prompt rows have null step statistics)."""
    import pyarrow as pa

    f32, i32 = pa.float32(), pa.int32()
    return with_pandas_types(
        pa.schema(
            [
                ("sequence", i32),
                ("position", i32),
                ("step", i32),
                ("is_prompt", pa.bool_()),
                ("token_id", i32),
                ("token_text", pa.string()),
                ("logprob", f32),
                ("prob", f32),
                ("sampling_logprob", f32),
                ("sampling_prob", f32),
                ("token_rank", i32),
                ("entropy", f32),
                ("greedy_id", i32),
                ("margin", f32),
                ("stability", pa.string()),
                ("filter_changed", pa.bool_()),
                ("eligible", i32),
                ("is_eos", pa.bool_()),
                ("alt_ids", pa.list_(i32)),
                ("alt_logits", pa.list_(f32)),
                ("alt_logprobs", pa.list_(f32)),
            ]
        ),
        ("sequence", "position", "is_prompt", "token_id"),
    )


def step_schema(columns: list[str]):
    import pyarrow as pa

    types = {
        "sequence": pa.int32(),
        "step": pa.int32(),
        "layer": pa.int32(),
        "lens_top1": pa.int32(),
        "lens_target_rank": pa.int32(),
        "lens_runner_up_rank": pa.int32(),
        "settle_layer": pa.int32(),
    }
    return with_pandas_types(
        pa.schema([(c, types.get(c, pa.float32())) for c in columns]), ("sequence", "step", "layer")
    )


def vocab_schema():
    """vocab.parquet: `text` is what `tokenizer.decode([id])` gives (as tokens.parquet's `token_text`)."""
    import pyarrow as pa

    return pa.schema([("id", pa.int32()), ("text", pa.string()), ("is_special", pa.bool_())])


def sequence_schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("sequence", pa.int32()),
            ("batch", pa.int32()),
            ("prompt", pa.string()),
            ("prompt_rendered", pa.string()),
            ("prompt_len", pa.int32()),
            ("generated_len", pa.int32()),
            ("stop_reason", pa.string()),
            ("generated_text", pa.string()),
        ]
    )
