"""`lmtrace generate`: a spec (or a run to resume) checked, run into a run archive, its summary printed.

`GenerateJob.prepare` makes every check that needs no model, in the order a user meets them (the
shard, the spec or the run to resume, the shared run id of a sharded run, `preflight`, `--lens`,
the run directory), so a bad spec fails in a second, before torch is imported; `run` generates
(runner/generation.py); `print_summary` prints what happened and gives the exit code. Resuming an
intervene child (its edits replayed from its parent) and `--lens` are the intervene and lens
commands' own steps: the CLI calls them between these (no command imports another)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from ..exits.errors import SpecError
from ..output.jsonout import json_line


class GenerateJob:
    """One `lmtrace generate`: what it was asked, and what `prepare` resolved from it."""

    def __init__(self, *, runs_dir: str | None, run_id: str | None, resume: str | None):
        self.runs_dir, self.run_id, self.resume = runs_dir, run_id, resume
        self.spec = None  # the run spec, once loaded (RunSpec)
        self.text = ""  # the spec as given
        self.shard = None  # archive.rundir.Shard, once parsed
        self.child = False  # an intervene child being resumed: its edits are replayed from its parent
        self.lens = False  # compute the deferred lens after generating

    @property
    def run_ref(self) -> str | None:
        """The run this job writes (a resumed run, or the run id given or chosen), for an error line."""
        return self.resume or self.run_id

    def prepare(
        self,
        spec_path: Path | None,
        overrides: list[str],
        *,
        shard: str | None,
        memory_budget: str | None,
        lens: bool,
        note: Callable[[str], None],
        saes: list[str] = (),
    ) -> None:
        """Every check that needs no model weights; `note` gets the line that says torch is next."""
        from ..spec.run_spec import load_spec

        shard_obj, slurm_run_id = None, None
        if shard is not None:  # importing the runner imports torch (seconds): plain spec errors stay fast
            from ..archive.rundir import parse_shard

            shard_obj, slurm_run_id = parse_shard(shard)
        if self.resume:
            if saes:
                raise SpecError(
                    "--sae cannot change a run being resumed; it continues with the SAEs it was started with"
                )
            from ..runner.resume import run_kind, spec_for_resume

            spec, text = spec_for_resume(
                self.resume,
                self.runs_dir,
                list(overrides) + ([f"generation.memory_budget={memory_budget}"] if memory_budget is not None else []),
            )
            self.run_id = spec.output.run_id
            self.child = run_kind(self.resume, self.runs_dir) == "intervene"
        else:
            if spec_path is None:
                raise SpecError("give a SPEC file, or --resume RUN_ID")
            self.run_id = self.run_id or slurm_run_id
            given = list(overrides) + ([f"output.run_id={json.dumps(self.run_id)}"] if self.run_id else [])
            if memory_budget is not None:
                given.append(f"generation.memory_budget={json.dumps(memory_budget)}")
            spec, text, _ = load_spec(spec_path, given)  # before torch is even imported: bad specs fail fast
            if saes:  # --sae DIR: one more capture.features entry each, with the default top_k
                from ..spec.sections import FeatureCapture

                spec.capture.features.extend(FeatureCapture(sae=str(Path(d).expanduser().resolve())) for d in saes)
        if shard_obj is not None and shard_obj.count > 1 and spec.output.run_id is None:
            raise SpecError(
                "a sharded run needs a shared run id: pass --run-id (with --shard auto it is "
                "slurm-<SLURM_ARRAY_JOB_ID>)"
            )
        from ..runner.model_config import preflight

        if not self.child:  # (a child's prompts are its parent's archived ones)
            preflight(spec, self.runs_dir)  # prompts, runs dir, model reference and layers, before loading weights
        note("spec checked; importing torch")  # the first line within a second; torch takes seconds
        from ..archive.rundir import check_target, parse_shard
        from ..archive.runs import runs_root
        from ..runner import generation  # noqa: F401 - torch, imported now that the spec is known to be valid

        if shard_obj is None:
            shard_obj, _ = parse_shard(None)
        if lens and not spec.capture.lens_deferred:
            if not spec.capture.lens_inline:
                raise SpecError(
                    "--lens: this spec captures no logit lens (capture.lens.enabled: false, or "
                    "capture: none); drop --lens or enable the lens"
                )
            lens = False  # an inline lens is computed during generation anyway
        check_target(
            runs_root(self.runs_dir, spec.output.runs_dir),
            spec,
            shard_obj,
            bool(self.resume),
            kind="intervene" if self.child else "generate",
        )
        self.spec, self.text, self.shard, self.lens = spec, text, shard_obj, lens

    def run(self, progress):
        """Generate (a new run, a shard of one, or a resumed run); the runner's GenerateResult."""
        from ..runner.generation import run_generate

        return run_generate(
            self.spec,
            self.text,
            runs_dir_flag=self.runs_dir,
            shard=self.shard,
            resume=bool(self.resume),
            progress=progress,
        )


def print_summary(
    result,
    lens_summary: dict | None,
    lens_text: str | None,
    *,
    lens: bool,
    quiet: bool,
    json_out: bool,
    log_json: bool,
    message: Callable[..., None],
) -> int:
    """What the run came to, on stdout (a line and the first texts, the run id alone with --quiet, or
    JSON), with a `finished` event for --log-json; the exit code (a shard complete whose siblings
    failed: EXIT_PARTIAL_SHARDS). `lens_text`: the line `--lens` adds (as `lmtrace lens` prints it)."""
    summary = {
        "run_id": result.run_id,
        "run_dir": str(result.run_dir),
        "status": result.status,
        "sequences": result.n_sequences,
        "generated_tokens": result.n_tokens,
        "seconds": round(result.seconds, 2),
        **({"lens": lens_summary} if lens else {}),
    }
    if log_json:
        message(f"run {result.run_id}: {result.status}", event="finished", **summary)
    if result.status.startswith("shard-complete-others-failed:"):
        import sys

        from ..exits.errors import EXIT_PARTIAL_SHARDS

        others = result.status.split(":", 1)[1]
        print(
            f"error: this shard is complete, but {others} of run {result.run_id} failed or was interrupted; "
            f"rerun it with `lmtrace generate --resume {result.run_id} --shard I/N`",
            file=sys.stderr,
        )
        return EXIT_PARTIAL_SHARDS
    if json_out:
        print(json_line(summary))
    elif quiet:  # the run id alone, for scripts: RUN=$(lmtrace generate spec.yaml -q)
        print(result.run_id)
    else:
        what = (
            "this shard is complete; the run completes when its other shards do"
            if result.status == "shard-complete"
            else result.status
        )
        print(
            f"run {result.run_id}: {what}, {result.n_sequences} sequence(s), "
            f"{result.n_tokens} tokens in {result.seconds:.1f}s -> {result.run_dir}"
        )
        for i, text in enumerate(result.texts[:5]):
            print(f"  [{i}] {text!r}")
        if len(result.texts) > 5:
            print(f"  ... {len(result.texts) - 5} more (lmtrace show {result.run_id})")
        if lens_text is not None:
            print(f"  {lens_text}")
    return 0
