"""What `capture.head_dla` costs per decode step, against the decode step itself (min of N timings).

On the embedded model (float32, batch 1, 64-token prompt, torch threads as bench.py sets them):
times one KV-cached decode forward without probes, interleaved with the same forward with only the head_dla taps
attached (the output projections' inputs, block 0's input, the final norm's input, the attention and
MLP outputs), and `Probes._direct_logit_attribution` on what that forward left (the per-step
arithmetic in `collect`). Each is the minimum of --repeats timings, which is robust to other
processes on a shared machine in a way a mean over a whole run (bench/components.py --head-dla) is not.

    .venv/bin/python bench/dla_cost.py [--repeats 30]

docs/archive.md ("Direct logit attribution") quotes its output.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from lmtrace.archive.layout import RunShape  # noqa: E402
from lmtrace.capture.arch import adapter_for  # noqa: E402
from lmtrace.capture.kv_cache import StackedCache  # noqa: E402
from lmtrace.capture.probes import ForwardContext, Probes  # noqa: E402
from lmtrace.capture.sampling import Sampler, choose  # noqa: E402
from lmtrace.runner.models import load_model  # noqa: E402
from lmtrace.spec.run_spec import ModelSpec  # noqa: E402


def best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: as bench.py)")
    args = p.parse_args()
    bench.set_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(ModelSpec())
    model = loaded.model
    adapter = adapter_for(model)
    _, prompt_ids = bench.make_prompt(loaded.tokenizer)
    T = len(prompt_ids)
    shape = RunShape(
        n_sequences=1,
        n_steps=2,
        max_prompt=T,
        layers=tuple(range(adapter.n_layers)),
        resid_layers=(),
        n_heads=adapter.n_heads,
        n_kv_heads=adapter.n_kv_heads,
        head_dim=adapter.head_dim,
        d_model=adapter.d_model,
        d_ffn=adapter.d_ffn or 0,
        kv_head_of_head=tuple(adapter.kv_head_of_head()),
        attention=False,
        qkv=False,
        ffn=False,
        lens=False,
        head_dla=True,
    )
    probes = Probes(adapter, shape, component_norms=False, margin_contributions=False)
    cache = StackedCache.for_generation(model.config, T, 2 + 4 * args.repeats, torch.device("cpu"))
    ids = torch.tensor([prompt_ids])
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    pos = [T]

    def decode():  # one more token each time (the context grows by `repeats` keys at most: negligible)
        model(
            input_ids=ids[:, -1:], position_ids=torch.tensor([[pos[0]]]), cache=cache, use_cache=True, logits_to_keep=1
        )
        pos[0] += 1

    def tapped():
        probes.begin(ForwardContext(pads=[0], total_len=pos[0] + 1, prefill=False, kv=cache.stack))
        decode()

    plain = with_taps = float("inf")
    for _ in range(args.repeats):  # interleaved, so that both see the same load
        plain = min(plain, best_ms(decode, 1))
        with probes.attached():
            with_taps = min(with_taps, best_ms(tapped, 1))
    with probes.attached():
        tapped()
        logits = out.logits[:, -1].float()
        choice = choose(logits, Sampler(0.0, 0, 1.0), None, 10)
        arithmetic = best_ms(lambda: probes._direct_logit_attribution(choice), args.repeats)
    taps = max(0.0, with_taps - plain)
    print(f"decode step (no probes)            {plain:7.2f} ms")
    print(f"decode step with head_dla taps     {with_taps:7.2f} ms  (taps +{taps:.2f} ms)")
    print(f"head_dla arithmetic in collect     {arithmetic:7.2f} ms")
    print(
        f"head_dla total                     {taps + arithmetic:7.2f} ms = {100 * (taps + arithmetic) / plain:.1f} % "
        f"of a decode step (threads {torch.get_num_threads()})"
    )
    assert np.isfinite(probes._direct_logit_attribution(choice)["head_dla"]).all()


if __name__ == "__main__":
    main()
