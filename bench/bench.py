"""Throughput and memory benchmark of lmtrace generation against a plain KV-cached loop.

What is measured (embedded:smollm2-135m, CPU or whatever `device: auto` picks, batch of 1, greedy,
one non-chat prompt of exactly 64 tokens, N new tokens for each N in --tokens):

  floor         a minimal loop written here: one prefill call and one decode call per token with
                `cache=DynamicCache(...)`, `logits_to_keep=1`, explicit attention mask and position
                ids (the same call pattern as lmtrace's tracer), argmax; no hooks. The model is loaded
                once through `lmtrace.runner.models.load_model(ModelSpec())` (sdpa attention).
  floor-stacked the same loop with lmtrace's KV cache (lmtrace/kv_cache.py: DynamicCache's values,
                appended in place instead of concatenated). lmtrace's loop uses that cache, the floor
                keeps transformers' own; this row shows how much of lmtrace's ratio the cache
                accounts for. No target.
  default       `lmtrace.runner.generation.run_generate` with the default capture (`capture.preset: standard`:
                attention rows, FFN top-k, norms, margin contributions, and the float16 residual at
                every layer for the deferred logit lens; no q/k/v) streamed to a run archive. Its deferred lens is then
                computed as `lmtrace lens` does, and that time (model load excluded) is reported
                separately, per generated token.
  forward-only  `run_generate` with `capture: none`.
  inline-lens   the default capture with `capture.lens.when: inline` (the lens per step, during
                generation); no target, reported for comparison.
  features      the default capture plus `capture.features`: one random TopK SAE (d_sae 16384, k 32,
                seeded, written once to a temporary directory) at blocks.15.hook_resid_post, each
                token's top 32 latents archived; the issue's target is <= 10 % over default
                (compare its "vs floor" with default's). Not timed by default.

Timed by default: floor, default and forward-only (the configurations with a target); `--configs
all` adds floor-stacked, inline-lens and features.

Timing: the floor is timed around its own loop (prefill + N-1 decodes, perf_counter); lmtrace runs
use the manifest's `timings.generate_s` (prefill to archive drained), so the model reload that
`run_generate` does on every call is excluded. The end-of-sequence id is set to a token the greedy
continuation never produces, and every run is checked to have generated exactly N tokens (and the
same tokens as the floor). Each measurement is repeated (--repeats), after a short warm-up of each
configuration. Every sample of a configuration runs between two floor samples (floor, A, floor, B,
floor, C, floor, D, then the next repeat, in an order rotated per repeat; one more floor sample
closes each N). tok/s = N / seconds, median of the samples. The ratio "vs floor" (and the targets)
is the median over the repeats of floor seconds / configuration seconds, where the floor seconds
are those the floor would have taken at the moment the configuration ran: interpolated linearly in
time between the floor samples just before and just after it. On the development VM the speed of
the same loop drifts by ±15 % in phases about as long as one sample, so a ratio of two medians can
compare a fast phase with a slow one (measured: forward-only, which only adds token statistics to
the floor, came out at 0.92x as a ratio of medians and 1.04x paired). Before the floor ran around
every sample, it ran once per repeat, and a floor sample four samples back had often left the
phase the configuration ran in: in one run the floor's 128-token samples went 8.1, 6.8, 6.7, 6.0 s
and forward-only came out at 0.84x there and 1.09x at 512 tokens. Five repeats by default, not
three: one paired ratio still spreads by about ±0.08 on this VM. Measured on ten paired 128-token
repeats of the default capture (ratios 0.85 to 1.12, median 0.905): the median of any 3 of them
spread with a standard deviation of 0.031 (lowest 0.862), the median of any 5 with 0.019 (lowest
0.863); at three repeats one run in two or three missed 0.85x at one of the two lengths, on a
capture that sits around 0.9x. Only the configurations with a target are timed by default, so that
five repeats take about as long as three did with all five configurations (~18 min).

Also reported: "best vs best" (fastest floor / fastest configuration: other load only ever slows
a run down) and the ratio of medians (JSON), and the process's CPU seconds over the same span (all
threads), paired the same way; their ratio is less sensitive to other load on the machine, since
time slices lost to other processes are not counted (spin-waiting threads still are).

Archive size: bytes of the run directory after completion divided by the generated tokens.

Peak RSS: for a fair "flat in steps" comparison each (configuration, N) runs once more in its own
child process (`python bench/bench.py --child ...`, after all timing), which reports its peak RSS
after the run, so every number is that run's own peak (imports and model load included, identically
for all). The peak is VmHWM from /proc/self/status, not ru_maxrss: on Linux a child's ru_maxrss
starts at the parent's peak (it survives fork+exec), which here would hide the run's own peak.

Output: a table on stdout (rich when stdout is a terminal, plain text otherwise) and
bench/results/latest.json. Usage:

    .venv/bin/python bench/bench.py                 # 128 and 512 new tokens, 5 repeats
    .venv/bin/python bench/bench.py --quick         # 32 and 64 new tokens, 1 repeat (smoke test)
    .venv/bin/python bench/bench.py --configs all --repeats 3   # also floor-stacked and inline-lens
    .venv/bin/python bench/bench.py --profile 128   # instead: cProfile a floor and a default run
                                                    # and print where the extra time goes

Timings are only meaningful on an otherwise idle machine: before each timed sample the script waits
(up to --quiet-timeout s) until other processes use less than --quiet of the CPUs, redoes a sample
they disturbed (up to --retries times), and reports the others' share next to every result. Every
kept sample is checkpointed to bench/results/partial.json; `--resume` continues a killed run.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import platform
import pstats
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", category=UserWarning, module="zarr")

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

DEFAULT_THREADS = torch.get_num_threads()  # read before anything can change it

from transformers import DynamicCache  # noqa: E402

from lmtrace.archive.runs import dir_size, package_versions  # noqa: E402
from lmtrace.capture.kv_cache import StackedCache  # noqa: E402
from lmtrace.runner.generation import Progress, run_generate  # noqa: E402
from lmtrace.runner.models import load_model  # noqa: E402
from lmtrace.spec.run_spec import ModelSpec, build_spec  # noqa: E402

MODEL_REF = "embedded:smollm2-135m"
PROMPT_TOKENS = 64
CONFIGS = ("floor", "floor-stacked", "default", "forward-only", "inline-lens", "features")
TARGET_RATIO = {"default": 0.85, "forward-only": 0.97}
RSS_FLAT_TOLERANCE = 0.10  # peak RSS at the largest N within 10% of the smallest N
WARMUP_TOKENS = 8
RESULTS = Path(__file__).resolve().parent / "results" / "latest.json"
CHILD_MARK = "BENCH-CHILD-RESULT "
PROMPT_SEED_TEXT = (
    "The history of the lighthouse begins with fires lit on hilltops to guide ships along dangerous "
    "coasts. Over centuries these beacons became towers of stone, fitted with lamps, mirrors and "
    "finally great glass lenses that could throw a beam many miles out to sea. Keepers lived beside "
    "them in small cottages, trimming wicks, polishing brass and writing the weather in their logs. "
    "Today most lights are automatic, yet the towers remain, standing over the rocks and the waves. "
)


# ---- set-up -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="32 and 64 new tokens, 1 repeat (smoke test)")
    p.add_argument(
        "--tokens",
        type=lambda s: [int(x) for x in s.split(",") if x.strip()],
        help="comma-separated new-token counts (default 128,512; 32,64 with --quick)",
    )
    p.add_argument("--repeats", type=int, help="timed repeats per measurement (default 5; 1 with --quick)")
    p.add_argument(
        "--configs",
        default=",".join(TARGET_RATIO),
        help="comma-separated configurations timed against the floor, or 'all' (default "
        f"{','.join(TARGET_RATIO)}: those with a target; all adds "
        f"{','.join(c for c in CONFIGS[1:] if c not in TARGET_RATIO)})",
    )
    p.add_argument(
        "--quiet",
        type=float,
        default=0.03,
        help="max share of the CPUs other processes may use during a timed sample (default 0.03)",
    )
    p.add_argument(
        "--quiet-timeout",
        type=float,
        help="seconds to wait for a quiet machine before each sample (default 120; 0 with --quick)",
    )
    p.add_argument(
        "--retries", type=int, help="redo a disturbed sample up to this many times (default 3; 0 with --quick)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted benchmark from its checkpoint (results/partial.json)",
    )
    p.add_argument("--no-rss", action="store_true", help="skip the child-process peak-RSS runs")
    p.add_argument("--output", type=Path, default=RESULTS, help=f"JSON results path (default {RESULTS})")
    p.add_argument(
        "--profile",
        type=int,
        metavar="N",
        help="instead of the benchmark, cProfile a floor and a default-capture run of N tokens "
        "and print where the extra time goes",
    )
    p.add_argument(
        "--profile-clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cProfile timer for --profile: wall time, or this process's CPU time (robust to other load)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)  # JSON job for one peak-RSS child run
    args = p.parse_args(argv)
    args.tokens = args.tokens or ([32, 64] if args.quick else [128, 512])
    args.repeats = args.repeats or (1 if args.quick else 5)
    wanted = (
        set(CONFIGS) if args.configs.strip() == "all" else {c.strip() for c in args.configs.split(",") if c.strip()}
    )
    unknown = wanted - set(CONFIGS)
    if unknown:
        p.error(
            f"--configs: unknown configuration(s) {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS[1:])} or all"
        )
    args.configs = tuple(c for c in CONFIGS if c == "floor" or c in wanted)  # in CONFIGS order, floor first
    if len(args.configs) < 2:
        p.error("--configs: name at least one configuration besides the floor")
    if args.quiet_timeout is None:
        args.quiet_timeout = 0.0 if args.quick else 120.0
    if args.retries is None:
        args.retries = 0 if args.quick else 3
    if min(args.tokens) < 1 or args.repeats < 1:
        p.error("--tokens and --repeats must be positive")
    return args


def set_threads() -> int:
    """Pin torch to its default intra-op thread count (what a plain `lmtrace generate` gets)."""
    torch.set_num_threads(DEFAULT_THREADS)
    return torch.get_num_threads()


def make_prompt(tokenizer, n_tokens: int = PROMPT_TOKENS) -> tuple[str, list[int]]:
    """A non-chat prompt that tokenises (as run_generate tokenises it) to exactly n_tokens ids."""
    words = (PROMPT_SEED_TEXT * (2 + n_tokens // 50)).split()
    for start in range(len(words)):  # add words until the count hits n_tokens exactly
        text = ""
        for word in words[start:]:
            text = f"{text} {word}".lstrip()
            ids = tokenizer(text)["input_ids"]
            if len(ids) == n_tokens:
                return text, ids
            if len(ids) > n_tokens:
                break
    raise RuntimeError(f"could not build a prompt of exactly {n_tokens} tokens")


def pick_eos(vocab_size: int, never: set[int]) -> int:
    """A valid vocabulary id the greedy continuation never produces, so every run reaches N tokens."""
    for candidate in range(vocab_size - 1, -1, -1):
        if candidate not in never:
            return candidate
    raise RuntimeError("no unused token id to use as eos")


def memory_mib() -> dict[str, float]:
    """This process's memory, MiB: peak RSS of its own address space (VmHWM), current RSS, ru_maxrss.

    ru_maxrss is recorded but not used: Linux carries the parent's peak over fork+exec into the
    child's ru_maxrss (signal->maxrss), so a child started by a big parent reports the parent's peak.
    VmHWM belongs to the address space the child got at exec, so it is the run's own peak.
    """
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"ru_maxrss": ru / (1024 * 1024) if sys.platform == "darwin" else ru / 1024}
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:  # not Linux: ru_maxrss is the best there is
        return {"peak": out["ru_maxrss"], "current": None, **out}
    kib = {
        line.split(":")[0]: int(line.split()[1]) for line in status.splitlines() if line.startswith(("VmHWM", "VmRSS"))
    }
    return {"peak": kib["VmHWM"] / 1024, "current": kib["VmRSS"] / 1024, **out}


# ---- the three configurations -----------------------------------------------------------------
@torch.inference_mode()
def floor_generate(model, prompt_ids: list[int], n_new: int, stacked: bool = False) -> tuple[list[int], float]:
    """Plain KV-cached greedy generation, no hooks. Returns (generated ids, seconds).

    The cache is transformers' DynamicCache, or with `stacked` lmtrace's StackedCache."""
    device = next(model.parameters()).device
    t0 = time.perf_counter()
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    positions = torch.arange(ids.shape[1], device=device)[None]
    cache = (
        StackedCache.for_generation(model.config, len(prompt_ids), n_new, device)
        if stacked
        else DynamicCache(config=model.config)
    )
    out_ids: list[int] = []
    for step in range(n_new):
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
        )
        token = out.logits[:, -1].argmax(-1)
        out_ids.append(int(token.item()))
        if step + 1 == n_new:
            break
        ids = token[:, None]
        mask = torch.cat([mask, torch.ones((1, 1), dtype=mask.dtype, device=device)], dim=1)
        positions = positions[:, -1:] + 1
    return out_ids, time.perf_counter() - t0


def floor_of(config: str, model, prompt_ids: list[int], n_new: int) -> tuple[list[int], float]:
    """The floor loop of configuration `floor` or `floor-stacked`."""
    return floor_generate(model, prompt_ids, n_new, stacked=config == "floor-stacked")


def spec_data(config: str, prompt: str, n_new: int, eos: int, runs_dir: str) -> dict:
    data = {
        "model": MODEL_REF,
        "prompts": {"texts": [prompt], "chat": False},
        "generation": {"max_new_tokens": n_new, "temperature": 0.0, "batch_size": 1, "eos_token_id": eos, "stop": []},
        "output": {"runs_dir": runs_dir},
    }
    if config == "forward-only":
        data["capture"] = "none"
    elif config == "inline-lens":  # the default capture with the logit lens computed per step
        data["capture"] = {"lens": {"when": "inline"}}
    elif config == "features":  # the default capture plus one SAE's top-32 latents per token
        data["capture"] = {"features": [{"sae": str(bench_sae()), "top_k": 32}]}
    return data


_SAE_DIR: list[Path] = []


def bench_sae() -> Path:
    """A random TopK SAE for SmolLM2-135M's residual after layer 15 (d_in 576, d_sae 16384, k 32),
    seeded, written once per process to a temporary directory (removed at exit)."""
    if not _SAE_DIR:
        import atexit

        from lmtrace.features import Sae, SaeConfig, write_sae

        folder = Path(tempfile.mkdtemp(prefix="lmtrace-bench-sae-"))
        atexit.register(shutil.rmtree, folder, True)
        g = torch.Generator().manual_seed(0)
        d_in, d_sae = 576, 16384
        w_dec = torch.randn(d_sae, d_in, generator=g)
        w_dec = w_dec / w_dec.norm(dim=-1, keepdim=True)
        sae = Sae(
            SaeConfig("topk", d_in, d_sae, "blocks.15.hook_resid_post", k=32),
            w_dec.T.clone(),
            torch.zeros(d_sae),
            w_dec,
            torch.zeros(d_in),
        )
        _SAE_DIR.append(write_sae(sae, folder / "bench-sae"))
    return _SAE_DIR[0]


def own_cpu_s() -> float:
    """CPU seconds used by this process so far, all threads (torch workers and writer included)."""
    t = os.times()
    return t.user + t.system


def lmtrace_generate(
    config: str, prompt: str, n_new: int, eos: int, runs_dir: str, on_start=None, deferred_lens: bool = False
) -> dict:
    """One run_generate call; returns its generate_s, generated ids and archive size (run dir removed).

    With deferred_lens (default configuration, timed samples) the run's deferred logit lens is then
    computed as `lmtrace lens` would, and its seconds without the model load are returned as lens_s
    (archive size measured before, like the other configurations).

    cpu_s is the process CPU time from generation start to run_generate's return (the finalisation
    after generate_s, ~0.1 s, is included).

    on_start is called when generation starts (after the model load), e.g. to snapshot memory.
    """
    data = spec_data(config, prompt, n_new, eos, runs_dir)
    cpu_at_start: list[float] = []

    def started(n_prompts, max_tokens):
        cpu_at_start.append(own_cpu_s())
        if on_start:
            on_start()

    result = run_generate(
        build_spec(data, "bench"), yaml.safe_dump(data, sort_keys=False), progress=Progress(start=started)
    )
    cpu_s = own_cpu_s() - cpu_at_start[0]
    run_dir = Path(result.run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    seqs = pq.read_table(run_dir / "sequences.parquet").to_pylist()
    tokens = pq.read_table(run_dir / "tokens.parquet", columns=["is_prompt", "step", "token_id"]).to_pylist()
    generated = [r["token_id"] for r in sorted((r for r in tokens if not r["is_prompt"]), key=lambda r: r["step"])]
    info = {
        "seconds": float(manifest["timings"]["generate_s"]),
        "cpu_s": cpu_s,
        "generated_len": int(seqs[0]["generated_len"]),
        "stop_reason": seqs[0]["stop_reason"],
        "generated": generated,
        "archive_bytes": dir_size(run_dir),
        "status": manifest["status"],
    }
    if deferred_lens and config == "default":
        from lmtrace.archive.reader import Run
        from lmtrace.commands.lens import compute_lens

        summary = compute_lens(Run(run_dir))
        info["lens_s"] = summary["seconds"] - summary["model_load_s"]
    shutil.rmtree(run_dir, ignore_errors=True)
    gc.collect()  # run_generate loaded its own model: free it before the next measurement
    return info


def check_run(config: str, info: dict, n_new: int, floor_ids: list[int]) -> bool:
    """Every run must be complete with exactly n_new tokens; returns whether they equal the floor's."""
    if info["status"] != "complete" or info["generated_len"] != n_new:
        raise RuntimeError(
            f"{config}: run generated {info['generated_len']} of {n_new} tokens "
            f"(status {info['status']}, stop {info['stop_reason']}); the benchmark would be unfair"
        )
    return info["generated"] == floor_ids[:n_new]


# ---- other load on the machine ---------------------------------------------------------------
def _cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine since boot, CPU seconds of this process, all threads)."""
    own = own_cpu_s()
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:  # not Linux: other load cannot be seen
        return own, own
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK"), own


class OthersMeter:
    """Share of the machine's CPU used by other processes while the block runs (0 = quiet, 1 = all)."""

    share: float | None = None

    def __enter__(self):
        self._t0, (self._busy0, self._own0) = time.perf_counter(), _cpu_seconds()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self._t0
        busy, own = _cpu_seconds()
        others = max(0.0, (busy - self._busy0) - (own - self._own0))
        self.share = others / max(wall * (os.cpu_count() or 1), 1e-9)
        return False


def wait_for_quiet(threshold: float, timeout: float, log) -> None:
    """Sleep until other processes use < threshold of the CPUs over 2 s, or for at most timeout s."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with OthersMeter() as meter:
            time.sleep(2.0)
        if meter.share < threshold:
            return
        log(f"    machine busy (others use {meter.share:.0%} of the CPUs), waiting")


# ---- checkpoint (--resume) --------------------------------------------------------------------
def key(config: str, n: int) -> str:
    return f"{config}:{n}"


class Checkpoint:
    """Kept samples and RSS results, saved after each one, so `--resume` continues a killed run.

    Only a checkpoint of the same benchmark (model, prompt, eos, token counts, repeats, threads) is
    reused; it is removed once the results are written.
    """

    def __init__(self, path: Path, identity: dict, resume: bool):
        self.path, self.identity = path, identity
        data = json.loads(path.read_text()) if resume and path.is_file() else {}
        same = data.get("identity") == identity
        self.samples: dict[str, dict] = data.get("samples", {}) if same else {}
        self.rss: dict[str, dict] = data.get("rss", {}) if same else {}
        self.resumed = bool(self.samples or self.rss)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps({"identity": self.identity, "samples": self.samples, "rss": self.rss}))
        os.replace(tmp, self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


# ---- timing (this process) --------------------------------------------------------------------
def warm_up(model, prompt: str, prompt_ids: list[int], eos: int, runs_dir: str, configs: tuple[str, ...]) -> None:
    for config in configs:
        if config.startswith("floor"):
            floor_of(config, model, prompt_ids, WARMUP_TOKENS)
        else:
            lmtrace_generate(config, prompt, WARMUP_TOKENS, eos, runs_dir)


def one_sample(
    config: str, n: int, model, prompt: str, prompt_ids: list[int], eos: int, floor_ids: list[int], runs_dir: str
) -> dict:
    """Generation seconds, process CPU seconds, archive bytes and same-tokens-as-floor of one run."""
    if config.startswith("floor"):
        cpu0 = own_cpu_s()
        ids, seconds = floor_of(config, model, prompt_ids, n)
        return {"seconds": seconds, "cpu_s": own_cpu_s() - cpu0, "archive_bytes": 0, "same": ids == floor_ids[:n]}
    info = lmtrace_generate(config, prompt, n, eos, runs_dir, deferred_lens=True)
    return {**info, "same": check_run(config, info, n, floor_ids)}


def schedule(repeats: int, configs: tuple[str, ...]) -> list[tuple[int, str, int]]:
    """(repeat, configuration, its sample index) in the order they run, for one N.

    Every sample of a configuration runs between two floor samples, so the floor it is compared
    with (interpolated between them in time, `floor_at`) is at most one sample away on either side;
    the configurations' order is rotated per repeat, so that none always follows another. One more
    floor sample closes the N.
    """
    others = [c for c in configs if c != "floor"]
    order: list[tuple[int, str]] = []
    for rep in range(repeats):
        for config in others[rep % len(others) :] + others[: rep % len(others)]:
            order += [(rep, "floor"), (rep, config)]
    order.append((repeats - 1, "floor"))
    seen: dict[str, int] = {}
    out = []
    for rep, config in order:
        out.append((rep, config, seen.get(config, 0)))
        seen[config] = seen.get(config, 0) + 1
    return out


def time_all(
    model,
    prompt: str,
    prompt_ids: list[int],
    eos: int,
    floor_ids: list[int],
    args,
    runs_dir: str,
    ckpt: Checkpoint,
    log,
) -> dict:
    """{"config:n": samples}, the configurations interleaved within each repeat.

    Before each sample the machine must be quiet (other processes below args.quiet of the CPUs); a
    sample during which others took more than that is redone, up to args.retries times, and the
    fastest attempt is kept (other load can only slow a run down). The others' share of every kept
    sample is recorded. Samples already in the checkpoint are not run again.
    """
    samples = ckpt.samples
    for c in args.configs:
        for n in args.tokens:
            samples.setdefault(
                key(c, n),
                {"seconds": [], "cpu_s": [], "others_cpu": [], "attempts": [], "archive_bytes": 0, "same_tokens": True},
            )
    for n in args.tokens:
        for rep, config, k in schedule(args.repeats, args.configs):
            entry = samples[key(config, n)]
            if len(entry["seconds"]) > k:  # already sampled (a resumed run)
                continue
            attempts = []
            for _ in range(args.retries + 1):
                wait_for_quiet(args.quiet, args.quiet_timeout, log)
                with OthersMeter() as meter:
                    t0 = time.time()
                    run = one_sample(config, n, model, prompt, prompt_ids, eos, floor_ids, runs_dir)
                    run["at"] = t0 + run["seconds"] / 2  # about the middle of the timed span
                attempts.append((meter.share, run))
                log(
                    f"  {config:<12} N={n:<5} repeat {rep + 1}/{args.repeats}: {run['seconds']:7.2f} s "
                    f"({n / run['seconds']:6.1f} tok/s, CPU {run['cpu_s']:.1f} s), others used {meter.share:.0%} of the CPUs"
                )
                if meter.share < args.quiet:
                    break
            share, run = min(attempts, key=lambda a: a[1]["seconds"])  # other load only slows a run down
            entry["seconds"].append(run["seconds"])
            entry.setdefault("at", []).append(round(run["at"], 3))
            entry["cpu_s"].append(round(run["cpu_s"], 3))
            entry["others_cpu"].append(round(share, 4))
            entry["attempts"].append(len(attempts))
            entry["archive_bytes"] = run["archive_bytes"]
            entry["same_tokens"] = entry["same_tokens"] and run["same"]
            if "lens_s" in run:
                entry.setdefault("lens_s", []).append(round(run["lens_s"], 3))
            ckpt.save()
    return samples


# ---- peak RSS (child processes) ---------------------------------------------------------------
def child_main(job: dict) -> dict:
    """Runs in a fresh process: one generation, then report this process's own memory peak."""
    threads = set_threads()
    config, n = job["config"], job["tokens"]
    at_start: dict = {}
    snapshot = lambda: at_start.update(memory_mib())  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="lmtrace-bench-rss-") as runs_dir:
        if config.startswith("floor"):
            loaded = load_model(ModelSpec(ref=MODEL_REF))
            snapshot()
            generated = len(floor_of(config, loaded.model, job["prompt_ids"], n)[0])
        else:
            generated = lmtrace_generate(config, job["prompt"], n, job["eos"], runs_dir, on_start=snapshot)[
                "generated_len"
            ]
    end = memory_mib()
    return {
        "config": config,
        "tokens": n,
        "generated": generated,
        "threads": threads,
        "peak_rss_mib": end["peak"],
        "ru_maxrss_mib": end["ru_maxrss"],
        "rss_at_generation_start_mib": at_start.get("current"),
        "peak_before_generation_mib": at_start.get("peak"),
    }


def measure_rss(jobs: list[dict], ckpt: Checkpoint, log) -> dict[str, dict]:
    """{"config:n": child result}: each job in its own fresh interpreter, sequentially, after all timing."""
    out = ckpt.rss
    for job in jobs:
        if key(job["config"], job["tokens"]) in out:
            continue
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(job)], capture_output=True, text=True
        )
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(CHILD_MARK)), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(
                f"RSS child {job['config']} N={job['tokens']} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
            )
        res = json.loads(line[len(CHILD_MARK) :])
        if res["generated"] != job["tokens"]:
            raise RuntimeError(f"RSS child {job['config']} generated {res['generated']} of {job['tokens']} tokens")
        out[key(job["config"], job["tokens"])] = res
        ckpt.save()
        log(
            f"  {job['config']:<12} N={job['tokens']:<5} peak RSS {res['peak_rss_mib']:7.1f} MiB "
            f"(RSS at generation start {res['rss_at_generation_start_mib']:.1f} MiB)"
        )
    return out


# ---- summary ----------------------------------------------------------------------------------
def floor_at(floor: dict, at: list[float], field: str) -> list[float]:
    """The floor's `field` (seconds or cpu_s) at each of the times `at`: linear in time between the
    floor samples just before and just after (`schedule` runs one on either side of every sample)."""
    times, values = zip(*sorted(zip(floor["at"], floor[field])))
    return np.interp(at, times, values).tolist()


def summarize(samples: dict, rss: dict, tokens: list[int], configs: tuple[str, ...]) -> list[dict]:
    rows = []
    for n in tokens:
        floor = samples[key("floor", n)]
        for config in configs:
            s = samples[key(config, n)]
            median_s = statistics.median(s["seconds"])
            tps = n / median_s
            # the floor as it ran at the same moment (interpolated between the floor samples around
            # it): their ratio cancels the machine's slow phases, which last about as long as a
            # sample and would otherwise hit one side only
            if config == "floor":
                ratio = cpu_ratio = 1.0
            else:
                ratio = statistics.median(f / c for f, c in zip(floor_at(floor, s["at"], "seconds"), s["seconds"]))
                cpu_ratio = statistics.median(f / c for f, c in zip(floor_at(floor, s["at"], "cpu_s"), s["cpu_s"]))
            target = TARGET_RATIO.get(config)
            rows.append(
                {
                    "config": config,
                    "tokens": n,
                    "seconds": s["seconds"],
                    "median_s": round(median_s, 4),
                    "tok_per_s": round(tps, 2),
                    "ratio_vs_floor": round(ratio, 4),
                    "ratio_of_medians": round(statistics.median(floor["seconds"]) / median_s, 4),
                    "best_ratio": round(min(floor["seconds"]) / min(s["seconds"]), 4),
                    "cpu_s": s["cpu_s"],
                    "cpu_ratio_vs_floor": round(cpu_ratio, 4),
                    "target_ratio": target,
                    "meets_target": None if target is None else ratio >= target,
                    "archive_bytes": s["archive_bytes"],
                    "archive_bytes_per_token": round(s["archive_bytes"] / n, 1),
                    "best_tok_per_s": round(n / min(s["seconds"]), 2),
                    **rss_fields(rss.get(key(config, n))),
                    "same_tokens_as_floor": s["same_tokens"],
                    "deferred_lens_s": s.get("lens_s"),
                    "deferred_lens_ms_per_token": (
                        round(statistics.median(s["lens_s"]) / n * 1000, 2) if s.get("lens_s") else None
                    ),
                    "others_cpu_max": max(s["others_cpu"]),
                    "others_cpu": s["others_cpu"],
                    "attempts": s["attempts"],
                }
            )
    return rows


def rss_fields(child: dict | None) -> dict:
    keys = ("peak_rss_mib", "rss_at_generation_start_mib", "ru_maxrss_mib")
    return {k: None if child is None or child.get(k) is None else round(child[k], 1) for k in keys}


def rss_flatness(rss: dict, tokens: list[int], configs: tuple[str, ...]) -> dict | None:
    """Peak RSS growth from the smallest to the largest N, default capture (the others for reference)."""
    lo, hi = min(tokens), max(tokens)
    if lo == hi or "default" not in configs or not all(key(c, n) in rss for c in configs for n in (lo, hi)):
        return None
    out = {"from_tokens": lo, "to_tokens": hi, "tolerance": RSS_FLAT_TOLERANCE}
    for config in configs:
        a, b = rss[key(config, lo)]["peak_rss_mib"], rss[key(config, hi)]["peak_rss_mib"]
        out[config] = {
            "rss_lo_mib": round(a, 1),
            "rss_hi_mib": round(b, 1),
            "growth_mib": round(b - a, 1),
            "growth_frac": round((b - a) / a, 4),
        }
    out["flat"] = out["default"]["growth_frac"] <= RSS_FLAT_TOLERANCE
    return out


def target_lines(rows: list[dict], flat: dict | None) -> list[str]:
    lines = []
    lens = [r for r in rows if r.get("deferred_lens_ms_per_token") is not None]
    if lens:
        lines.append(
            "deferred logit lens of the default runs, computed afterwards (`lmtrace lens`, model load "
            "excluded): " + ", ".join(f"N={r['tokens']}: {r['deferred_lens_ms_per_token']:.1f} ms/token" for r in lens)
        )
    for config, target in TARGET_RATIO.items():
        got = ", ".join(
            f"N={r['tokens']}: {r['ratio_vs_floor']:.3f}x {'PASS' if r['meets_target'] else 'FAIL'}"
            for r in rows
            if r["config"] == config
        )
        lines.append(f"target {config} >= {target:.2f}x floor   {got or 'not measured (not in --configs)'}")
    if flat is None:
        lines.append("target RSS flat in steps   not measured (needs two token counts and the RSS children)")
    else:
        d, f = flat["default"], flat["floor"]
        lines.append(
            f"target RSS flat in steps (default, growth <= {flat['tolerance']:.0%})   "
            f"N={flat['from_tokens']}: {d['rss_lo_mib']:.0f} MiB -> N={flat['to_tokens']}: {d['rss_hi_mib']:.0f} MiB "
            f"({d['growth_mib']:+.0f} MiB, {d['growth_frac']:+.1%}) {'PASS' if flat['flat'] else 'FAIL'}; "
            f"floor {f['growth_mib']:+.0f} MiB ({f['growth_frac']:+.1%})"
        )
    return lines


def print_table(rows: list[dict], flat: dict | None, meta: dict) -> None:
    headers = [
        "configuration",
        "new tokens",
        "tok/s",
        "vs floor",
        "target",
        "best vs best",
        "vs floor (CPU s)",
        "archive B/token",
        "peak RSS MiB",
        "same tokens",
        "others' CPU",
    ]
    table = [
        [
            r["config"],
            str(r["tokens"]),
            f"{r['tok_per_s']:.1f}",
            f"{r['ratio_vs_floor']:.3f}x",
            ""
            if r["target_ratio"] is None
            else f">= {r['target_ratio']:.2f}x " + ("ok" if r["meets_target"] else "MISS"),
            f"{r['best_ratio']:.3f}x",
            f"{r['cpu_ratio_vs_floor']:.3f}x",
            f"{r['archive_bytes_per_token']:,.0f}",
            "-" if r["peak_rss_mib"] is None else f"{r['peak_rss_mib']:.0f}",
            "yes" if r["same_tokens_as_floor"] else "NO",
            f"{r['others_cpu_max']:.0%}",
        ]
        for r in rows
    ]
    title = (
        f"lmtrace bench: {meta['model']}, prompt {meta['prompt_tokens']} tokens, batch 1, greedy, "
        f"{meta['device']}, torch threads {meta['torch_threads']}; tok/s: median of {meta['repeats']}; "
        f"vs floor: median of the {meta['repeats']} repeats' ratios to the floor at that moment (interpolated between the floor samples around each)"
    )
    footer = target_lines(rows, flat)
    noisy = [f"{r['config']} N={r['tokens']}" for r in rows if r["others_cpu_max"] >= meta["quiet_threshold"]]
    if noisy:
        footer.append(
            f"WARNING: other processes used >= {meta['quiet_threshold']:.0%} of the CPUs during "
            f"{', '.join(noisy)}; those timings are disturbed (see others' CPU)"
        )
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for i, h in enumerate(headers):
            t.add_column(h, justify="left" if i == 0 else "right")
        for row in table:
            t.add_row(*row)
        console = Console()
        console.print(t)
        for line in footer:
            console.print(line, markup=False, highlight=False)
        return
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    print(title)
    print(fmt.format(*headers))
    print("  ".join("-" * w for w in widths))
    for row in table:
        print(fmt.format(*row))
    print()
    for line in footer:
        print(line)


def write_json(path: Path, meta: dict, rows: list[dict], flat: dict | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    targets = {"ratio_vs_floor": TARGET_RATIO, "rss_flat_tolerance": RSS_FLAT_TOLERANCE}
    path.write_text(
        json.dumps({"meta": meta, "targets": targets, "results": rows, "rss_flatness": flat}, indent=2) + "\n"
    )


# ---- profile (--profile N) -------------------------------------------------------------------
def _profiled_writer_thread(store: dict):
    """Patch (in this process only) BackgroundWriter._run so its worker thread is profiled too."""
    from lmtrace.archive.writer import BackgroundWriter

    original = BackgroundWriter._run

    def run(self):
        store["profile"] = prof = cProfile.Profile()
        t0 = time.thread_time()
        prof.enable()
        try:
            original(self)
        finally:
            prof.disable()
            store["cpu_s"] = time.thread_time() - t0

    BackgroundWriter._run = run
    return lambda: setattr(BackgroundWriter, "_run", original)


def _cum(stats: pstats.Stats, where: str, name: str, caller: str | None = None) -> float:
    """Cumulative seconds of functions `name` in files containing `where` (only calls from `caller`)."""
    total = 0.0
    for (file, _, func), (_, _, _, ct, callers) in stats.stats.items():
        if func == name and where in file:
            total += ct if caller is None else sum(v[3] for (_, _, fn), v in callers.items() if fn == caller)
    return total


def extra_breakdown(floor: pstats.Stats, default: pstats.Stats) -> list[tuple[str, float, float]]:
    """(where, floor s, default s) for the parts of one generation loop, both under cProfile."""
    d = lambda where, name, caller=None: _cum(default, where, name, caller)  # noqa: E731
    rows = [
        (
            "model(...) calls",
            _cum(floor, "torch", "_wrapped_call_impl", "floor_generate"),
            d("torch", "_wrapped_call_impl", "run_batch"),
        ),
        ("  in it: probe hooks (probes.py hook)", 0.0, d("probes.py", "hook")),
        (
            "  in it: lmtrace attention fn, sdpa excluded",
            0.0,
            d("attention.py", "_lmtrace_attention")
            - d("sdpa_attention", "sdpa_attention_forward", "_lmtrace_attention"),
        ),
        ("probes.collect", 0.0, d("probes.py", "collect")),
        ("  in it: probes._logit_lens", 0.0, d("probes.py", "_logit_lens")),
        ("sampling.choose", 0.0, d("sampling.py", "choose")),
        ("BlockSink.on_step", 0.0, d("sink.py", "on_step")),
        ("probes.begin", 0.0, d("probes.py", "begin")),
    ]
    loop_floor, loop_default = _cum(floor, "bench", "floor_generate"), d("tracer.py", "run_batch")
    top = [r for r in rows if not r[0].startswith("  ")]
    rows.append(("rest of the loop", loop_floor - sum(r[1] for r in top), loop_default - sum(r[2] for r in top)))
    rows.append(("whole loop (floor_generate / Tracer.run_batch)", loop_floor, loop_default))
    rows.append(("writer waits after the loop (BackgroundWriter.drain)", 0.0, d("writer.py", "drain")))
    return rows


def profile_default(n: int, clock: str, out_dir: Path, log) -> None:
    """cProfile one floor run and one default-capture run of n tokens; print where the extra time goes."""
    set_threads()
    loaded = load_model(ModelSpec(ref=MODEL_REF))
    prompt, prompt_ids = make_prompt(loaded.tokenizer)
    floor_ids, _ = floor_generate(loaded.model, prompt_ids, n)
    eos = pick_eos(loaded.model.config.vocab_size, set(floor_ids) | set(prompt_ids))
    out_dir.mkdir(parents=True, exist_ok=True)
    new_profile = lambda: cProfile.Profile(time.process_time) if clock == "cpu" else cProfile.Profile()  # noqa: E731
    floor_prof, main_prof, writer = new_profile(), new_profile(), {}
    with tempfile.TemporaryDirectory(prefix="lmtrace-bench-prof-") as runs_dir:
        warm_up(loaded.model, prompt, prompt_ids, eos, runs_dir, ("floor", "default"))
        with OthersMeter() as quiet_floor:
            _, floor_s = floor_generate(loaded.model, prompt_ids, n)  # unprofiled reference
        floor_prof.runcall(floor_generate, loaded.model, prompt_ids, n)
        restore = _profiled_writer_thread(writer)
        try:
            with OthersMeter() as quiet_default:
                info = main_prof.runcall(lmtrace_generate, "default", prompt, n, eos, runs_dir)
        finally:
            restore()
    main_prof.dump_stats(out_dir / f"profile-default-{n}.prof")
    floor_prof.dump_stats(out_dir / f"profile-floor-{n}.prof")
    print(f"floor {n} tokens: {floor_s:.2f} s unprofiled (others used {quiet_floor.share:.0%} of the CPUs)")
    print(
        f"default capture {n} tokens: generate_s {info['seconds']:.2f} s under cProfile "
        f"(others used {quiet_default.share:.0%})"
    )
    if clock == "cpu":
        print("profile clock: process CPU time (all threads) while each function is on the main thread's stack")
    print(f"writer thread CPU time: {writer.get('cpu_s', float('nan')):.2f} s (zarr's codec threads not included)\n")
    stats = pstats.Stats(main_prof, stream=sys.stdout)
    print("== where the extra time goes: both loops under cProfile, seconds ==")
    print(f"{'':<56}{'floor':>9}{'default':>9}{'extra':>9}")
    for where, f, dflt in extra_breakdown(pstats.Stats(floor_prof), stats):
        print(f"{where:<56}{f:>9.2f}{dflt:>9.2f}{dflt - f:>9.2f}")
    print("\n== main thread, lmtrace functions by cumulative time (top 15) ==")
    stats.sort_stats("cumulative").print_stats(r"lmtrace[/\\]", 15)
    print("== main thread, all functions by own time (top 15) ==")
    stats.sort_stats("tottime").print_stats(15)
    if "profile" in writer:
        writer["profile"].dump_stats(out_dir / f"profile-default-{n}-writer.prof")
        print("== writer thread, by cumulative time (top 15; lock waits are idle time) ==")
        pstats.Stats(writer["profile"], stream=sys.stdout).sort_stats("cumulative").print_stats(15)
    log(f"wrote {out_dir}/profile-*-{n}*.prof")


# ---- main -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # so temporary dirs are removed
    if args.child:
        print(CHILD_MARK + json.dumps(child_main(json.loads(args.child))), flush=True)
        return 0
    if args.profile:
        profile_default(args.profile, args.profile_clock, args.output.parent, log)
        return 0
    threads = set_threads()
    started = time.time()
    load_start = list(os.getloadavg())  # other processes on the machine skew timings; recorded
    log(f"loading {MODEL_REF} (torch threads {threads})")
    loaded = load_model(ModelSpec(ref=MODEL_REF))
    model, tokenizer = loaded.model, loaded.tokenizer
    device, dtype = str(loaded.device), str(loaded.dtype).replace("torch.", "")
    prompt, prompt_ids = make_prompt(tokenizer)
    floor_ids, _ = floor_generate(model, prompt_ids, max(args.tokens))  # the reference continuation
    eos = pick_eos(model.config.vocab_size, set(floor_ids) | set(prompt_ids))
    log(f"prompt {len(prompt_ids)} tokens; eos set to unused id {eos}; tokens {args.tokens}, repeats {args.repeats}")
    identity = {
        "model": MODEL_REF,
        "prompt_ids": prompt_ids,
        "eos": eos,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "threads": threads,
        "retries": args.retries,
        "quiet": args.quiet,
        "schedule": "floor around every sample",
        "configs": list(args.configs),
    }  # samples of another schedule are not mixed in
    ckpt = Checkpoint(args.output.with_name("partial.json"), identity, args.resume)
    if ckpt.resumed:
        log(f"resuming from {ckpt.path}")
    elif args.resume:
        log(f"no checkpoint of this benchmark in {ckpt.path}: starting from the beginning")

    with tempfile.TemporaryDirectory(prefix="lmtrace-bench-") as runs_dir:
        log("warm-up")
        warm_up(model, prompt, prompt_ids, eos, runs_dir, args.configs)
        log("timing")
        samples = time_all(model, prompt, prompt_ids, eos, floor_ids, args, runs_dir, ckpt, log)
    rss = {}
    if not args.no_rss:
        log("peak RSS, one child process per run")
        del model, loaded
        gc.collect()
        jobs = [
            {"config": c, "tokens": n, "prompt": prompt, "prompt_ids": prompt_ids, "eos": eos}
            for n in args.tokens
            for c in args.configs
        ]
        rss = measure_rss(jobs, ckpt, log)

    rows = summarize(samples, rss, args.tokens, args.configs)
    flat = rss_flatness(rss, args.tokens, args.configs)
    meta = {
        "model": MODEL_REF,
        "device": device,
        "dtype": dtype,
        "attn_implementation": "sdpa",
        "prompt_tokens": len(prompt_ids),
        "prompt": prompt,
        "eos_token_id": eos,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "configs": list(args.configs),
        "quick": args.quick,
        "torch_threads": threads,
        "torch_default_threads": DEFAULT_THREADS,
        "cpu_count": os.cpu_count(),
        "quiet_threshold": args.quiet,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "packages": package_versions(),
        "timing": "floor: own loop (perf_counter); lmtrace: manifest timings.generate_s",
        "rss": "VmHWM (peak RSS of its own address space) of a fresh child process per (configuration, tokens), "
        "read after its run; the child's ru_maxrss is recorded too but inherits the parent's peak across exec",
        "loadavg_start": load_start,
        "loadavg_end": list(os.getloadavg()),
        "resumed": ckpt.resumed,
        "wall_s": round(time.time() - started, 1),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print_table(rows, flat, meta)
    write_json(args.output, meta, rows, flat)
    ckpt.remove()
    log(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
