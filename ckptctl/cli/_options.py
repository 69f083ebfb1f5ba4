"""Option aliases shared by the commands, so a flag means the same everywhere.

One definition per flag: its help, metavar, help panel, environment variable and limits.
Defaults of the seed-compatible flags are fixed by the CLI contract (SGLang's example script)
and are written where the commands use the aliases.

The help is read at 80 columns: every option names its value with a short metavar (`URL`,
`N`, `SECONDS`), flags show none (Typer would print `<bool>`), and limits are checked by a
callback rather than shown as Typer's `[1<=x<=65536]` ranges, which push the help text into
a column too narrow to read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from ckptctl.cli._choices import EngineChoice, RegisterModeChoice, SplitChoice
from ckptctl.defaults import API_KEY_ENV, CONTROL_SOCKET_ENV, ENDPOINT_ENV, ENGINE_ENV, UDS_ENV
from ckptctl.defaults import DEFAULT_ENDPOINT as DEFAULT_ENDPOINT  # (wait_ready imports it here)

# Help panels: `update` has two dozen flags; they are grouped by what they are about. Typer
# shows a flag in no panel under "Options", first: every flag here has one.
CHECKPOINT = "Checkpoint"
SERVER = "Inference server"
TRANSFER = "Transfer"
DRY_RUN = "Dry run (no GPU, no server, no torchrun)"
SERVE_JOB = "Serve job"
WAITING = "Waiting"
OUTPUT = "Output"
VERIFY = "Verifying what the server holds"

FLAG = ""  # the metavar of an on/off flag: nothing (Typer would show <bool>)


def at_least(low: float, high: float | None = None) -> Callable[[Any], Any]:
    """A callback that refuses a value below `low` (or above `high`) with a usage error."""

    def check(value: Any) -> Any:
        if value is None:
            return value
        if value < low:
            raise typer.BadParameter(f"must be at least {low:g}, not {value:g}")
        if high is not None and value > high:
            raise typer.BadParameter(f"must be at most {high:g}, not {value:g}")
        return value

    return check


# -- every command ------------------------------------------------------------------------------


def show_help(ctx: typer.Context, value: bool) -> None:
    """What Typer's own --help does (the command is registered with add_help_option=False)."""
    if value and not ctx.resilient_parsing:
        typer.echo(ctx.get_help(), color=ctx.color)
        raise typer.Exit()


HelpOpt = Annotated[
    bool,
    typer.Option(
        "--help",
        metavar=FLAG,
        is_eager=True,
        expose_value=False,
        callback=show_help,
        rich_help_panel=OUTPUT,
        help="Show this message (every option) and exit; -h: the short form.",
    ),
]

JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        metavar=FLAG,
        rich_help_panel=OUTPUT,
        help="Print exactly one JSON document on stdout, on every outcome: "
        '{"ok", "exit_code", "error", ...}. Logs go to stderr.',
    ),
]
QuietOpt = Annotated[
    bool,
    typer.Option(
        "--quiet",
        "-q",
        metavar=FLAG,
        rich_help_panel=OUTPUT,
        help="No logs or progress; errors still go to stderr.",
    ),
]
VerboseOpt = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        metavar=FLAG,
        rich_help_panel=OUTPUT,
        help="Also show checkpoint-engine's own log.",
    ),
]

# -- the inference server -----------------------------------------------------------------------


def _from_env(name: str, metavar: str, envvar: str, help: str) -> Any:
    """A server flag that a script may set once in the environment instead (shown in --help)."""
    return typer.Option(
        name, metavar=metavar, envvar=envvar, show_envvar=True, rich_help_panel=SERVER, help=help
    )


_ENDPOINT_HELP = "Base URL of the inference server"
_UDS_HELP = "Unix socket of the inference server"
EndpointOpt = Annotated[
    str,
    _from_env(
        "--endpoint",
        "URL",
        ENDPOINT_ENV,
        f"{_ENDPOINT_HELP} (with --uds only its path and Host matter).",
    ),
]
EndpointsOpt = Annotated[
    list[str] | None,
    _from_env(
        "--endpoint",
        "URL",
        ENDPOINT_ENV,
        f"{_ENDPOINT_HELP}. Give it once per server group on this node, in group order, to "
        "feed several servers from one torchrun (in the environment variable: separated by "
        "spaces).",
    ),
]
UdsOpt = Annotated[
    str | None, _from_env("--uds", "PATH", UDS_ENV, f"{_UDS_HELP}, used for every HTTP call.")
]
UdsListOpt = Annotated[
    list[str] | None,
    _from_env(
        "--uds",
        "PATH",
        UDS_ENV,
        f"{_UDS_HELP} for every HTTP call; once per group like --endpoint.",
    ),
]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        metavar="KEY",
        envvar=API_KEY_ENV,
        show_envvar=True,
        show_default=False,
        rich_help_panel=SERVER,
        help="Bearer token for the server (SGLang --api-key or --admin-api-key, vLLM "
        "--api-key). Prefer the environment variable: a flag shows in the process list. "
        "Never printed.",
    ),
]
EngineOpt = Annotated[
    EngineChoice,
    typer.Option(
        "--engine",
        metavar="ENGINE",
        envvar=ENGINE_ENV,
        show_envvar=True,
        rich_help_panel=SERVER,
        help="Which server speaks at the endpoint: sglang or vllm.",
    ),
]
WeightVersionOpt = Annotated[
    str | None,
    typer.Option(
        "--weight-version",
        metavar="VERSION",
        rich_help_panel=SERVER,
        help="Weight version string (SGLang records and reports it).",
    ),
]
InferenceParallelSizeOpt = Annotated[
    int,
    typer.Option(
        "--inference-parallel-size",
        metavar="N",
        callback=at_least(1),
        rich_help_panel=SERVER,
        help="GPUs of each inference server (its TP size): ranks are grouped by it and the "
        "first rank of each group talks to that group's server.",
    ),
]


def _timeout(low: float, panel: str, help: str) -> Any:
    return typer.Option(
        "--timeout", metavar="SECONDS", callback=at_least(low), rich_help_panel=panel, help=help
    )


TimeoutOpt = Annotated[float, _timeout(0, TRANSFER, "Give up after this many seconds (exit 4).")]
# push and rollback: how long the command waits for the job's answer.
AnswerTimeoutOpt = Annotated[
    float,
    _timeout(
        1,
        WAITING,
        "Seconds to wait for the job's answer (exit 4); the serve job bounds each push by its "
        "own --push-timeout.",
    ),
]

# -- the checkpoint (update, save-metas, join) --------------------------------------------------


def _checkpoint_path(more: str = "") -> Any:
    return typer.Option(
        "--checkpoint-path",
        metavar="DIR",
        show_default=False,
        rich_help_panel=CHECKPOINT,
        help="Checkpoint directory: safetensors shards with their index.json, one "
        "model.safetensors, or a directory of .safetensors files." + more,
    )


CheckpointPathOpt = Annotated[Path, _checkpoint_path()]
# update: a checkpoint, or --load-metas-file to join.
CheckpointPathOrJoinOpt = Annotated[
    Path | None, _checkpoint_path(" Required unless --load-metas-file is given.")
]


def _checkpoint_name(help: str) -> Any:
    return typer.Option("--checkpoint-name", metavar="NAME", rich_help_panel=CHECKPOINT, help=help)


CheckpointNameOpt = Annotated[str, _checkpoint_name("Name the checkpoint is registered under.")]
PushNameOpt = Annotated[
    str | None, _checkpoint_name("Name to register it under (default: push-N).")
]


def _load_metas_file(help: str) -> Any:
    return typer.Option(
        "--load-metas-file",
        metavar="FILE",
        show_default=False,
        rich_help_panel=CHECKPOINT,
        help=help,
    )


LoadMetasFileOpt = Annotated[
    Path,
    _load_metas_file("Metas file written by `ckptctl save-metas` (or `update --save-metas-file`)."),
]
# update --load-metas-file: the seed script's join mode.
JoinFromMetasOpt = Annotated[
    Path | None,
    _load_metas_file(
        "Join instead: pull the weights over p2p from the holders this metas file names (as "
        "`ckptctl join`); no checkpoint is read."
    ),
]
SplitOpt = Annotated[
    SplitChoice,
    typer.Option(
        "--split",
        metavar="MODE",
        rich_help_panel=CHECKPOINT,
        help="files: whole files per rank; tensors: single tensors per rank; auto: "
        "whichever leaves the largest rank smaller (ties: files). Both balance bytes.",
    ),
]
RegisterModeOpt = Annotated[
    RegisterModeChoice,
    typer.Option(
        "--register-mode",
        metavar="MODE",
        rich_help_panel=CHECKPOINT,
        help="How each rank's share reaches pinned memory. direct: read straight into buffers "
        "pinned in place (the fastest, and half the host memory); engine: checkpoint-engine "
        "copies it from the file mapping into buffers it allocates.",
    ),
]
ReadThreadsOpt = Annotated[
    int | None,
    typer.Option(
        "--read-threads",
        metavar="N",
        callback=at_least(1, 256),
        show_default=False,
        rich_help_panel=CHECKPOINT,
        help="Threads each rank reads its share with (--register-mode direct). Default: the "
        "CPU cores it may use over the ranks on its node, at most 16.",
    ),
]
ConsumeShmOpt = Annotated[
    bool,
    typer.Option(
        "--consume-shm-files",
        metavar=FLAG,
        rich_help_panel=CHECKPOINT,
        help="For a checkpoint a trainer wrote into /dev/shm to be consumed: "
        "checkpoint-engine pins each .safetensors file in place and DELETES it (no second "
        "copy in memory). Each rank takes whole files. Without this flag ckptctl never "
        "modifies or deletes checkpoint files.",
    ),
]
AllowPickleOpt = Annotated[
    bool,
    typer.Option(
        "--allow-pickle",
        metavar=FLAG,
        rich_help_panel=CHECKPOINT,
        help="Also read a legacy pickle metas file, through a restricted unpickler that "
        "admits only checkpoint-engine's data models, torch dtypes and sizes.",
    ),
]

# -- the transfer ---------------------------------------------------------------------------------

BucketSizeOpt = Annotated[
    float | None,
    typer.Option(
        "--bucket-size-gb",
        metavar="N",
        callback=at_least(0.001),
        show_default=False,
        rich_help_panel=TRANSFER,
        help="Largest transfer bucket, in units of 2^30 bytes (GiB, as checkpoint-engine's "
        "PS_MAX_BUCKET_SIZE_GB counts; its default is 8).",
    ),
]
MemFractionOpt = Annotated[
    float | None,
    typer.Option(
        "--mem-fraction",
        metavar="FRACTION",
        callback=at_least(0.01, 1.0),
        show_default=False,
        rich_help_panel=TRANSFER,
        help="Share of free GPU memory the transfer buffers may use (checkpoint-engine's "
        "PS_MEM_FRACTION; its default is 0.9).",
    ),
]


def _sleep_time(help: str, **more: Any) -> Any:
    return typer.Option(
        "--sleep-time",
        metavar="SECONDS",
        callback=at_least(0),
        rich_help_panel=TRANSFER,
        help=help,
        **more,
    )


SleepTimeOpt = Annotated[
    float, _sleep_time("Seconds to stay alive after the update, serving the registered weights.")
]
# save-metas: until a signal unless given.
HoldTimeOpt = Annotated[
    float | None,
    _sleep_time(
        "Serve the weights for this many seconds, then unregister and exit 0. Default: until "
        "SIGTERM or SIGINT (then the same, cleanly).",
        show_default=False,
    ),
]
PushTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--push-timeout",
        metavar="SECONDS",
        callback=at_least(1),
        rich_help_panel=TRANSFER,
        help="Seconds one push may take (it fails with exit 4 past that; the job goes on).",
    ),
]

# -- the serve job's control socket ---------------------------------------------------------------

ControlSocketOpt = Annotated[
    str | None,
    typer.Option(
        "--control-socket",
        metavar="PATH",
        envvar=CONTROL_SOCKET_ENV,
        show_envvar=True,
        show_default=False,
        rich_help_panel=SERVE_JOB,
        # (No square brackets: help text is Rich markup, where [..] is a style tag.)
        help="Unix socket of this node's control endpoint. Default: serve-DIGEST.sock, "
        "named after the servers, in $XDG_RUNTIME_DIR/ckptctl/ or /tmp/ckptctl-UID/.",
    ),
]


# -- --verify (ckptctl/verify.py) -----------------------------------------------------------------

VerifyOpt = Annotated[
    bool,
    typer.Option(
        "--verify",
        metavar=FLAG,
        rich_help_panel=VERIFY,
        help="After the update, prove that the servers hold it, through SGLang's weights "
        "checker: the SHA-256 of every tensor where a server offers compare_checksum, else "
        "the same per-engine checksum on every server fed (SGLang >= 0.5.12, two or more "
        "servers). Exit 1 naming the tensors that differ; exit 3, before pushing, where it "
        "cannot be done.",
    ),
]
VerifyRoundTripOpt = Annotated[
    bool,
    typer.Option(
        "--verify-round-trip",
        metavar=FLAG,
        rich_help_panel=VERIFY,
        help="For the first update of a run, into a server started from this same checkpoint: "
        "snapshot its weights, reset them to random values, update, and have it compare "
        "(SGLang >= 0.5.12). Needs --reset-served-weights.",
    ),
]
ResetServedWeightsOpt = Annotated[
    bool,
    typer.Option(
        "--reset-served-weights",
        metavar=FLAG,
        rich_help_panel=VERIFY,
        help="Confirm --verify-round-trip: the server serves random weights from the reset "
        "until the update lands, and keeps them if the update fails.",
    ),
]
