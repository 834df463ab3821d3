"""How `--help` writes parameters: flags show no type, options show their metavar (RUN, DIR,
SPEC, N, ...), arguments are written RUN, [SPEC], RUN... as in POSIX usage lines.

typer's own rendering prints a Python type after every parameter (`--json <bool>`,
`--set <list[str]>`), which reads as if flags took values, and writes required arguments as
`{RUN}`. These three methods are the whole difference; on a typer without them nothing changes."""

from __future__ import annotations

from typer import core


def _option_type(self, ctx):
    if self.is_flag or getattr(self, "count", False):
        return None
    return self.metavar or "VALUE"


def _argument_type(self, ctx):
    return None  # the name column already says what it is


def _argument_name(self) -> str:
    name = self.metavar or self.name.upper()
    if self.metavar is None and self.nargs != 1:
        name += "..."
    return name


def _argument_usage(self) -> str:
    name = _argument_name(self)
    return name if self.required else f"[{name}]"


def install() -> None:
    patches = (
        (core.TyperOption, "display_type_rich", _option_type),
        (core.TyperArgument, "display_type_rich", _argument_type),
        (core.TyperArgument, "_rich_display_name", _argument_name),
        (core.TyperArgument, "_usage_display_name", _argument_usage),
    )
    for cls, attr, fn in patches:
        if hasattr(cls, attr):
            setattr(cls, attr, fn)


# The value each option takes, as `--help` shows it (one vocabulary for every command).
METAVARS = {
    "--set": "KEY=VALUE",
    "--runs-dir": "DIR",
    "--run-id": "ID",
    "--resume": "RUN_ID",
    "--shard": "I/N|auto",
    "--spec": "FILE",
    "--ablate-head": "LAYER.HEAD[:mean]",
    "--ablate-layer": "LAYER[:mean]",
    "--ablate-mlp": "LAYER[:mean]",
    "--ablate-attn": "LAYER[:mean]",
    "--ablate-neurons": "LAYER:N,N..[:mean]",
    "--mask-positions": "POSITIONS",
    "--from-step": "STEP",
    "--mode": "rescore|regenerate",
    "--temperatures": "T,T..",
    "--over": "COMPONENTS",
    "--edit": "zero|mean|patch",
    "--source": "RUN",
    "--metric": "METRIC",
    "--steps": "STEPS",
    "--sequences": "SEQUENCES",
    "--positions": "POSITIONS",
    "--batch": "N",
    "--top": "N",
    "--step": "STEP",
    "--sequence": "N",
    "--method": "METHOD",
    "--target": "chosen|runner-up|contrast",
    "--quantity": "logit|logprob",
    "--baseline": "mean|scaled-mean|pad|zero",
    "--ig-steps": "N",
    "--ig-rule": "adaptive|midpoint",
    "--ig-tolerance": "FRACTION",
    "--ig-max-points": "N",
    "--batch-size": "N",
    "--rollout-exclude": "POSITIONS",
    "--device": "DEVICE",
    "--out": "PATH",
    "--pair": "auto|index|prompt",
    "--html": "FILE",
    "--exact-steps": "STEPS",
    "--layer": "LAYER",
    "--attention-step": "STEP",
    "--png": "DIR",
    "--svg": "DIR",
    "--kind": "KIND",
}

# Help for the options many commands share, where a command gives none of its own.
SHARED_HELP = {
    "--runs-dir": "Runs directory (default: $LMTRACE_RUNS_DIR, else ./runs).",
    "--json": "Print the result as one line of JSON on stdout (the same words as the text output).",
    "--quiet": "Print nothing but errors.",
    "--run-id": "Id of the run to write (default: a new sortable id).",
    "--device": "Device for the model (default: the run's).",
}


def fill_in(app) -> None:
    """Give every option of every command its metavar and, for the shared ones, a help text."""
    import inspect

    from typer.models import OptionInfo

    for command in app.registered_commands:
        for param in inspect.signature(command.callback).parameters.values():
            info = param.default
            if not isinstance(info, OptionInfo):
                continue
            names = [n for n in info.param_decls or () if n.startswith("--")]
            if not names:
                continue
            if info.metavar is None and not isinstance(info.default, bool) and names[0] in METAVARS:
                info.metavar = METAVARS[names[0]]
            if not info.help and names[0] in SHARED_HELP:
                info.help = SHARED_HELP[names[0]]
