"""A parent run as the runs derived from it read it: its prompts, token ids, generated tokens and
stored alternatives (`ParentView`), its tokenizer, and its chat-template spans. Shared by
`intervene`, `sweep` and `explain` (which replays an intervention child's edits)."""

from __future__ import annotations

from dataclasses import dataclass

from ..archive.reader import Run
from ..exits.errors import SpecError
from ..spec.run_spec import build_spec


@dataclass
class ParentView:
    """What a child needs from its parent archive, read once."""

    run: Run
    prompts: list[str]
    rendered: list[str]
    prompt_ids: list[list[int]]
    generated: list[list[int]]
    alts: list[list[list[int]]]  # [seq][step] -> alt ids
    alt_logprobs: list[list[list[float]]]
    logprob: list[list[float]]
    margin: list[list[float]]
    greedy: list[list[int]]

    @classmethod
    def read(cls, run: Run) -> "ParentView":
        seqs = run.sequences().to_pandas().sort_values("sequence")
        tokens = run.tokens().to_pandas()
        n = len(seqs)
        prompt_ids, generated, alts, alt_lp, logprob, margin, greedy = ([[] for _ in range(n)] for _ in range(7))
        for seq, t in tokens.groupby("sequence"):
            t = t.sort_values("position")
            prompt_ids[seq] = t[t.is_prompt].token_id.tolist()
            g = t[~t.is_prompt].sort_values("step")
            generated[seq] = g.token_id.tolist()
            alts[seq] = [list(x) for x in g.alt_ids]
            alt_lp[seq] = [list(x) for x in g.alt_logprobs]
            logprob[seq] = g.logprob.tolist()
            margin[seq] = g.margin.tolist()
            greedy[seq] = g.greedy_id.tolist()
        return cls(
            run,
            seqs.prompt.tolist(),
            seqs.prompt_rendered.tolist(),
            prompt_ids,
            generated,
            alts,
            alt_lp,
            logprob,
            margin,
            greedy,
        )


def prompt_metadata_of(run: Run):
    """The parent's prompt metadata columns (sequences.parquet's columns past lmtrace's own), one row per
    sequence in sequence order, for a child to carry; None when it has none."""
    from ..archive import layout

    seqs = run.sequences().sort_by("sequence")
    own = set(layout.sequence_schema().names)
    columns = [c for c in seqs.column_names if c not in own]
    return seqs.select(columns) if columns else None


def tokenizer_of(run: Run):
    """The run's tokenizer, as `generate` loaded it (no weights are loaded)."""
    from .models import load_tokenizer

    return load_tokenizer(build_spec(run.manifest["spec_resolved"], f"spec of run {run.id}").model)


def chat_span_ranges(parent: Run, view: ParentView, span: str, where: str, tokenizer) -> dict[int, tuple[int, int]]:
    from ..spec.prompts import chat_spans

    prompts = parent.manifest["spec_resolved"]["prompts"]
    if not prompts.get("chat"):
        raise SpecError(
            f"{where}: span {span} needs a chat run, but parent run {parent.id} was not chat-templated "
            f"(prompts.chat: false); use span: prompt or explicit positions (mask)"
        )
    if span == "system" and not prompts.get("system"):
        raise SpecError(
            f"{where}: span system needs a system prompt, but parent run {parent.id} has none "
            f"(prompts.system is not set)"
        )
    out = {}
    for seq in range(len(view.prompt_ids)):
        spans = chat_spans(tokenizer, view.prompts[seq], prompts.get("system"), view.prompt_ids[seq])
        out[seq] = spans[span]
    return out
