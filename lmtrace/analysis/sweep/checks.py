"""The sweep's checks of its runs: the measured steps of a sequence, a patch source of the same model,
tokenizer and dtype (before the model is loaded), and `SweepError` (a baseline that does not reproduce
the run)."""

from __future__ import annotations

from ...exits.errors import LmtraceError, SpecError


class SweepError(LmtraceError):
    """The model does not reproduce the parent's archived log-probs: the baseline cannot be trusted."""


def measured_steps(text: str, from_step: int, n: int, seq: int, run_id: str) -> list[int]:
    """The steps measured in a sequence of n generated tokens; with from_step, only steps >= from_step exist."""
    from ...spec.steps import parse_steps

    if n == 0:
        raise SpecError(f"sequence {seq} of run {run_id} generated no tokens: nothing to measure")
    if from_step >= n:
        raise SpecError(
            f"--from-step {from_step}: sequence {seq} of run {run_id} has steps 0..{n - 1}, none is edited; "
            f"choose a smaller step or other --sequences"
        )
    steps = parse_steps(text, n)
    if text.strip() == "all":
        return [st for st in steps if st >= from_step]
    early = [st for st in steps if st < from_step]
    if early:
        raise SpecError(
            f"--steps: step(s) {early} come before --from-step {from_step}; their forward is the unedited "
            f"prefix, so measure steps {from_step} and later"
        )
    return steps


def check_source(parent, source) -> None:
    pm, sm = parent.manifest, source.manifest
    for what, a, b in (
        (
            "model weights",
            pm["model"].get("weights_sha256") or pm["model"]["reference"],
            sm["model"].get("weights_sha256") or sm["model"]["reference"],
        ),
        ("tokenizer", (pm.get("tokenizer") or {}).get("sha256"), (sm.get("tokenizer") or {}).get("sha256")),
        ("dtype", pm.get("dtype"), sm.get("dtype")),
    ):
        if a != b:
            raise SpecError(
                f"source run {source.id} differs from run {parent.id} in {what}; patching needs a source "
                f"run of the same model, tokenizer and dtype"
            )
