"""Help: `-h` the short form (usage, the main flags, examples), `--help` the full one.

`update --help` runs to 150 lines at 80 columns; a newcomer wants the few flags that matter and
a command to copy. The short form is plain text built from the lists below and the commands'
own signatures (defaults) and docstrings, so it cannot drift from the full one; a test checks
that every flag it names is in the full help. Example lines stay within 72 columns: Rich wraps
the epilog at the terminal's width, and a command broken mid-line cannot be pasted.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from enum import Enum
from typing import Annotated, Any

import typer
from rich.markup import escape

WIDTH = 80
EXAMPLE_CHARS = 72  # an example line, indented in the epilog, stays whole at 80 columns

EXIT_CODES_HELP = (
    "Exit codes: 0 success · 1 operation failed · 2 usage error · "
    "3 invalid input (checkpoint or metas file) · 4 timed out · 130 interrupted."
)

# (Typer's own --install-completion/--show-completion say "the current shell": one can be named.)
COMPLETION_HELP = (
    "Shell completion: ckptctl --install-completion [bash|zsh|fish] (default: the shell it "
    "runs in); --show-completion [SHELL] prints the script."
)

# Commands by how they are used, as the overview groups them.
PANELS: dict[str, tuple[str, ...]] = {
    "One-shot: check, then update under torchrun": ("doctor", "wait-ready", "update"),
    "Resident job: serve under torchrun, then push from the node": (
        "serve",
        "push",
        "stage",
        "rollback",
        "status",
        "stop",
    ),
    "Metas files and p2p": ("save-metas", "join", "inspect-metas"),
}

OVERVIEW_EXAMPLES = [
    "ckptctl update --dry-run --checkpoint-path DIR",
    "ckptctl wait-ready --timeout 600",
    "torchrun --nproc-per-node 8 --no-python ckptctl update \\",
    "    --checkpoint-path DIR --weight-version step-7",
    "torchrun --nproc-per-node 8 --no-python ckptctl serve &",
    "ckptctl push --wait 600 --checkpoint-path DIR",
    "ckptctl update -h",
    "ckptctl doctor --endpoint http://localhost:19730",
]

# A line ending in a backslash continues the command on the next.
EXAMPLES: dict[str, list[str]] = {
    "doctor": [
        "ckptctl doctor",
        "ckptctl doctor --endpoint http://localhost:19730 --json",
    ],
    "wait-ready": [
        "ckptctl wait-ready --timeout 600 && torchrun ... ckptctl update ...",
        "ckptctl wait-ready --for healthy --weight-version step-7 --timeout 60",
    ],
    "update": [
        "ckptctl update --dry-run --checkpoint-path DIR",
        "ckptctl update --dry-run --checkpoint-path DIR --world-size 16",
        "torchrun --nproc-per-node 8 --no-python ckptctl update \\",
        "    --checkpoint-path DIR --weight-version step-7",
        "torchrun --nproc-per-node 8 --no-python ckptctl update \\",
        "    --checkpoint-path DIR --inference-parallel-size 4 \\",
        "    --endpoint URL1 --endpoint URL2",
    ],
    "save-metas": [
        "torchrun --nproc-per-node 8 --no-python ckptctl save-metas \\",
        "    --checkpoint-path DIR --metas-file metas.json",
    ],
    "join": [
        "torchrun --nproc-per-node 8 --no-python ckptctl join \\",
        "    --load-metas-file metas.json",
    ],
    "inspect-metas": [
        "ckptctl inspect-metas metas.json",
        "ckptctl inspect-metas metas.json --checkpoint-path DIR --json",
    ],
    "serve": [
        "torchrun --nproc-per-node 8 --no-python ckptctl serve &",
        "ckptctl push --wait 600 --checkpoint-path DIR --weight-version step-7",
    ],
    "push": [
        "ckptctl push --wait 600 --checkpoint-path DIR --weight-version step-7",
        "ckptctl push --endpoint URL --checkpoint-path DIR --json",
    ],
    "stage": [
        "ckptctl stage --checkpoint-path DIR",
        "ckptctl push --checkpoint-path DIR --weight-version step-7",
    ],
    "rollback": ["ckptctl rollback", "ckptctl rollback --endpoint URL --json"],
    "status": [
        "ckptctl status",
        "ckptctl status --history",
        "ckptctl status --endpoint URL --json",
    ],
    "stop": ["ckptctl stop --wait 60"],
}

# The flags that matter most, per command, for `-h`: (flag as typed, what it does). Defaults
# come from the command's signature.
MAIN_FLAGS: dict[str, list[tuple[str, str]]] = {
    "doctor": [
        ("--endpoint URL", "also check this server (once per server)"),
        ("--api-key KEY", "the server's key, for its weights checker"),
        ("--timeout SECONDS", "how long the servers may take to answer, in all"),
        ("--json", "one JSON document on stdout"),
    ],
    "wait-ready": [
        ("--endpoint URL", "the server's base URL"),
        ("--for STATE", "listening (any HTTP answer) or healthy (HTTP 200)"),
        ("--weight-version VERSION", "also wait for this weight version (SGLang)"),
        ("--timeout SECONDS", "give up after this long (exit 4)"),
        ("--json", "one JSON document on stdout"),
    ],
    "update": [
        ("--checkpoint-path DIR", "the safetensors checkpoint (required)"),
        ("--endpoint URL", "the server's base URL, once per server group"),
        ("--inference-parallel-size N", "GPUs of each server (its TP size)"),
        ("--weight-version VERSION", "the version the server records"),
        ("--dry-run", "check the flags and plan the split: no GPU needed"),
        ("--world-size N", "with --dry-run: the ranks (default: one server group)"),
        ("--timeout SECONDS", "give up after this long (exit 4)"),
        ("--verify", "prove afterwards that the server holds the checkpoint"),
        ("--json", "one JSON document on stdout"),
        ("-q, --quiet", "no logs or progress"),
    ],
    "save-metas": [
        ("--checkpoint-path DIR", "the safetensors checkpoint (required)"),
        ("--save-metas-file FILE", "where rank 0 writes the metas file (required)"),
        ("--sleep-time SECONDS", "serve this long (default: until a signal)"),
        ("--json", "one JSON document on stdout"),
    ],
    "join": [
        ("--load-metas-file FILE", "the metas file of the holders (required)"),
        ("--endpoint URL", "this node's server"),
        ("--inference-parallel-size N", "GPUs of each server (its TP size)"),
        ("--json", "one JSON document on stdout"),
    ],
    "inspect-metas": [
        ("--checkpoint-path DIR", "also check the metas against this checkpoint"),
        ("--allow-pickle", "also read a legacy pickle metas file"),
        ("--json", "one JSON document on stdout"),
    ],
    "serve": [
        ("--endpoint URL", "the server's base URL, once per server group"),
        ("--inference-parallel-size N", "GPUs of each server (its TP size)"),
        ("--push-timeout SECONDS", "how long one push may take (exit 4)"),
        ("--server-start-wait SECONDS", "how long the first push waits for the server"),
        ("--server-wait SECONDS", "how long a later push waits for a server that is down"),
        ("--control-socket PATH", "where push, status and stop find the job"),
    ],
    "push": [
        ("--checkpoint-path DIR", "the safetensors checkpoint (required)"),
        ("--weight-version VERSION", "the version the server records"),
        ("--wait SECONDS", "wait this long for the job to answer"),
        ("--verify", "prove afterwards that the server holds the checkpoint"),
        ("--json", "one JSON document on stdout"),
    ],
    "stage": [
        ("--checkpoint-path DIR", "the checkpoint the next push sends (required)"),
        ("--endpoint URL", "the job that feeds this server"),
        ("--json", "one JSON document on stdout"),
    ],
    "rollback": [
        ("--endpoint URL", "the job that feeds this server"),
        ("--json", "one JSON document on stdout"),
    ],
    "status": [
        ("--history", "the job's pushes: outcome, version, seconds, when"),
        ("--endpoint URL", "the job that feeds this server"),
        ("--json", "one JSON document on stdout"),
    ],
    "stop": [
        ("--timeout SECONDS", "wait this long for every rank to end (exit 4)"),
        ("--json", "one JSON document on stdout"),
    ],
}

USAGE_ARGS = {"inspect-metas": "[OPTIONS] FILE"}
PARAMETER_OF = {"--json": "json_output", "--for": "for_", "-q": "quiet"}


def panel_of(command: str) -> str | None:
    return next((panel for panel, names in PANELS.items() if command in names), None)


def epilog(command: str | None = None) -> str:
    """Examples (where there are any) and the exit codes, as Rich markup."""
    lines = EXAMPLES.get(command or "", []) if command else OVERVIEW_EXAMPLES
    if not lines:
        return EXIT_CODES_HELP
    shown = "\n".join(f"  [bold]{escape(line)}[/bold]" for line in lines)
    extra = "" if command else f"{escape(COMPLETION_HELP)}\n\n"
    return f"Examples:\n{shown}\n\n{extra}{EXIT_CODES_HELP}"


def first_paragraph(doc: str | None) -> str:
    return " ".join(inspect.cleandoc(doc or "").split("\n\n")[0].split())


def default_of(func: Callable[..., Any], flag: str) -> str | None:
    """The default of `flag` (as typed, with its metavar) in `func`'s signature, as shown."""
    name = flag.split()[0].split(",")[0]
    param = PARAMETER_OF.get(name, name.lstrip("-").replace("-", "_"))
    found = inspect.signature(func).parameters.get(param)
    if found is None:
        return None
    value = found.default
    if value is inspect.Parameter.empty or value is None or isinstance(value, bool):
        return None
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, list):
        return " ".join(map(str, value))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def short_help(command: str, func: Callable[..., Any]) -> str:
    """`ckptctl COMMAND -h`: usage, what it does, the main flags, examples (under 60 lines)."""
    usage = f"Usage: ckptctl {command} {USAGE_ARGS.get(command, '[OPTIONS]')}"
    lines = [usage, "", *textwrap.wrap(first_paragraph(func.__doc__), WIDTH - 2), ""]
    lines.append("Main options:")
    flags = MAIN_FLAGS.get(command, [])
    column = max((len(flag) for flag, _ in flags), default=0) + 4
    for flag, text in flags:
        default = default_of(func, flag)
        text += f" [default: {default}]" if default else ""
        lines += textwrap.wrap(
            text,
            WIDTH - 2,
            initial_indent=f"  {flag}".ljust(column),
            subsequent_indent=" " * column,
        )
    examples = EXAMPLES.get(command, [])
    if examples:
        lines += ["", "Examples:", *(f"  {line}" for line in examples)]
    lines += ["", f"All options: ckptctl {command} --help"]
    lines += textwrap.wrap(EXIT_CODES_HELP, WIDTH - 2)
    return "\n".join(lines)


def with_short_help(command: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` taking `-h` too (the short form); Typer reads the parameters from its signature."""

    def show(value: bool) -> None:
        if value:
            typer.echo(short_help(command, func))
            raise typer.Exit()

    option = Annotated[
        bool,
        typer.Option(
            "-h",
            metavar="",
            is_eager=True,
            expose_value=False,
            callback=show,
            hidden=True,  # (--help says it)
            help="Show the short help: the main options and examples.",
        ),
    ]

    def wrapper(*args: Any, short_help: bool = False, **kwargs: Any) -> Any:
        return func(*args, **kwargs)  # (Typer passes every parameter it knows, this one too)

    signature = inspect.signature(func, eval_str=True)
    extra = inspect.Parameter(
        "short_help", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=option
    )
    params = list(signature.parameters.values())
    wrapper.__signature__ = signature.replace(parameters=[*params, extra])  # type: ignore[attr-defined]
    wrapper.__doc__ = func.__doc__
    wrapper.__name__ = func.__name__
    wrapper.__annotations__ = {p.name: p.annotation for p in [*params, extra]}
    return wrapper
