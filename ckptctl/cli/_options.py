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

import math
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckptctl.defaults import API_KEY_ENV, CONTROL_SOCKET_ENV, ENDPOINT_ENV, ENGINE_ENV, UDS_ENV
from ckptctl.settings import PauseMode, ServerKind, SplitMode

if TYPE_CHECKING:
    from ckptctl.cli._output import Output

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
        if not math.isfinite(value):  # (NaN passes every comparison: a wait without end)
            raise typer.BadParameter(f"must be a finite number, not {value:g}")
        if value < low:
            raise typer.BadParameter(f"must be at least {low:g}, not {value:g}")
        if high is not None and value > high:
            raise typer.BadParameter(f"must be at most {high:g}, not {value:g}")
        return value

    return check


def _opt(*names: str, panel: str, help: str, metavar: str = FLAG, **more: Any) -> Any:
    """One flag's typer.Option: its names, metavar (FLAG: an on/off flag), panel and help."""
    return typer.Option(*names, metavar=metavar, rich_help_panel=panel, help=help, **more)


# -- every command ------------------------------------------------------------------------------


def show_help(ctx: typer.Context, value: bool) -> None:
    """What Typer's own --help does (the command is registered with add_help_option=False)."""
    if value and not ctx.resilient_parsing:
        typer.echo(ctx.get_help(), color=ctx.color)
        raise typer.Exit()


HelpOpt = Annotated[
    bool,
    _opt(
        "--help",
        panel=OUTPUT,
        help="Show this message (every option) and exit; -h: the short form.",
        is_eager=True,
        expose_value=False,
        callback=show_help,
    ),
]
JsonOpt = Annotated[
    bool,
    _opt(
        "--json",
        panel=OUTPUT,
        help="Print exactly one JSON document on stdout, on every outcome: "
        '{"ok", "exit_code", "error", ...}. Logs go to stderr.',
    ),
]
QuietOpt = Annotated[
    bool,
    _opt("--quiet", "-q", panel=OUTPUT, help="No logs or progress; errors still go to stderr."),
]
VerboseOpt = Annotated[
    bool, _opt("--verbose", "-v", panel=OUTPUT, help="Also show checkpoint-engine's own log.")
]

# -- the inference server -----------------------------------------------------------------------


def _from_env(
    name: str, metavar: str, envvar: str, help: str, panel: str = SERVER, **more: Any
) -> Any:
    """A flag that a script may set once in the environment instead (shown in --help)."""
    return _opt(name, metavar=metavar, envvar=envvar, show_envvar=True, panel=panel, help=help,
                **more)  # fmt: skip


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
CheckEndpointsOpt = Annotated[
    list[str] | None,
    _from_env(
        "--endpoint",
        "URL",
        ENDPOINT_ENV,
        f"{_ENDPOINT_HELP} to check; give it once per server (the list update and serve take). "
        "Default: none (no server is checked).",
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
    _from_env(
        "--api-key",
        "KEY",
        API_KEY_ENV,
        "Bearer token for the server (SGLang --api-key or --admin-api-key, vLLM --api-key). "
        "Prefer the environment variable: a flag shows in the process list. Never printed.",
        show_default=False,
    ),
]
EngineOpt = Annotated[
    ServerKind,
    _from_env(
        "--engine", "ENGINE", ENGINE_ENV, "Which server speaks at the endpoint: sglang or vllm."
    ),
]
WeightVersionOpt = Annotated[
    str | None,
    _opt(
        "--weight-version",
        metavar="VERSION",
        panel=SERVER,
        help="Weight version string (SGLang records and reports it).",
    ),
]
_PAUSE_HELP = (
    "What the servers do with their generations in flight while the weights go in: none "
    "(the server's own way: SGLang's update waits for every one to end), or one of the "
    "server's pause modes - SGLang: abort, retract, in_place; vLLM: abort, wait, keep. "
    "Every server is paused before the transfer and resumed after it, also when it fails."
)
PauseOpt = Annotated[PauseMode, _opt("--pause", metavar="MODE", panel=SERVER, help=_PAUSE_HELP)]
PushPauseOpt = Annotated[
    PauseMode | None,
    _opt(
        "--pause",
        metavar="MODE",
        panel=SERVER,
        show_default=False,
        help=_PAUSE_HELP + " Default: the serve job's --pause.",
    ),
]
InferenceParallelSizeOpt = Annotated[
    int,
    _opt(
        "--inference-parallel-size",
        metavar="N",
        callback=at_least(1),
        panel=SERVER,
        help="GPUs of each inference server (its TP size): ranks are grouped by it and the "
        "first rank of each group talks to that group's server.",
    ),
]


def _timeout(low: float, panel: str, help: str) -> Any:
    return _opt("--timeout", metavar="SECONDS", callback=at_least(low), panel=panel, help=help)


# --timeout means one thing in every command: the longest the whole command may take (exit 4
# past it); --wait, in the commands that talk to a serve job, how long to wait first for a
# job to answer at all (docs/cli.md).
TimeoutOpt = Annotated[
    float, _timeout(1, TRANSFER, "Give up the whole command after this many seconds (exit 4).")
]
ClientTimeoutOpt = Annotated[
    float,
    _timeout(
        1,
        WAITING,
        "Give up the whole command after this many seconds, --wait included (exit 4). The "
        "serve job bounds each push itself (serve --push-timeout).",
    ),
]
WaitOpt = Annotated[
    float,
    _opt(
        "--wait",
        metavar="SECONDS",
        callback=at_least(0),
        panel=WAITING,
        help="First wait up to this many seconds for the serve job to answer at all (one that "
        "is still starting after `serve &`); exit 4 if none does.",
    ),
]

# -- the checkpoint (update, save-metas, join) --------------------------------------------------


def _checkpoint_path(more: str = "") -> Any:
    return _opt(
        "--checkpoint-path",
        metavar="DIR",
        show_default=False,
        panel=CHECKPOINT,
        help="Checkpoint directory: safetensors shards with their index.json, one "
        "model.safetensors, or a directory of .safetensors files." + more,
    )


CheckpointPathOpt = Annotated[Path, _checkpoint_path()]
CheckpointPathOrJoinOpt = Annotated[
    Path | None, _checkpoint_path(" Required unless --load-metas-file is given.")
]


def _checkpoint_name(help: str) -> Any:
    return _opt("--checkpoint-name", metavar="NAME", panel=CHECKPOINT, help=help)


CheckpointNameOpt = Annotated[str, _checkpoint_name("Name the checkpoint is registered under.")]
PushNameOpt = Annotated[
    str | None, _checkpoint_name("Name to register it under (default: push-N).")
]


def _load_metas_file(help: str) -> Any:
    return _opt(
        "--load-metas-file", metavar="FILE", show_default=False, panel=CHECKPOINT, help=help
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


class RegisterModeChoice(str, Enum):
    """--register-mode's choices (consume is asked for with its own flag, --consume-shm-files,
    as it deletes files)."""

    engine = "engine"
    direct = "direct"


SplitOpt = Annotated[
    SplitMode,
    _opt(
        "--split",
        metavar="MODE",
        panel=CHECKPOINT,
        help="files: whole files per rank; tensors: single tensors per rank; auto: "
        "whichever leaves the largest rank smaller (ties: files). Both balance bytes.",
    ),
]
RegisterModeOpt = Annotated[
    RegisterModeChoice,
    _opt(
        "--register-mode",
        metavar="MODE",
        panel=CHECKPOINT,
        help="How each rank's share reaches pinned memory. direct: read straight into buffers "
        "pinned in place (the fastest, and half the host memory); engine: checkpoint-engine "
        "copies it from the file mapping into buffers it allocates.",
    ),
]
ReadThreadsOpt = Annotated[
    int | None,
    _opt(
        "--read-threads",
        metavar="N",
        callback=at_least(1, 256),
        show_default=False,
        panel=CHECKPOINT,
        help="Threads each rank reads its share with (--register-mode direct). Default: the "
        "CPU cores it may use over the ranks on its node, at most 16.",
    ),
]
ConsumeShmOpt = Annotated[
    bool,
    _opt(
        "--consume-shm-files",
        panel=CHECKPOINT,
        help="For a checkpoint a trainer wrote into /dev/shm to be consumed: "
        "checkpoint-engine pins each .safetensors file in place and DELETES it (no second "
        "copy in memory). Each rank takes whole files. Without this flag ckptctl never "
        "modifies or deletes checkpoint files.",
    ),
]
AllowPickleOpt = Annotated[
    bool,
    _opt(
        "--allow-pickle",
        panel=CHECKPOINT,
        help="Also read a legacy pickle metas file, through a restricted unpickler that "
        "admits only checkpoint-engine's data models, torch dtypes and sizes.",
    ),
]

# -- the transfer ---------------------------------------------------------------------------------

BucketSizeOpt = Annotated[
    float | None,
    _opt(
        "--bucket-size-gb",
        metavar="N",
        callback=at_least(0.001),
        show_default=False,
        panel=TRANSFER,
        help="Largest transfer bucket, in units of 2^30 bytes (GiB, as checkpoint-engine's "
        "PS_MAX_BUCKET_SIZE_GB counts; its default is 8).",
    ),
]
MemFractionOpt = Annotated[
    float | None,
    _opt(
        "--mem-fraction",
        metavar="FRACTION",
        callback=at_least(0.01, 1.0),
        show_default=False,
        panel=TRANSFER,
        help="Share of free GPU memory the transfer buffers may use (checkpoint-engine's "
        "PS_MEM_FRACTION; its default is 0.9).",
    ),
]


def _sleep_time(help: str, **more: Any) -> Any:
    return _opt("--sleep-time", metavar="SECONDS", callback=at_least(0), panel=TRANSFER, help=help,
                **more)  # fmt: skip


# One meaning in both commands: how long the registered weights stay up for joiners once the
# command's work is done; only the defaults differ (the seed's 0 for update, a signal for
# save-metas, whose work is to hold them).
_SLEEP_TIME_HELP = (
    "Seconds to keep serving the registered weights to joiners once the work is done, then "
    "unregister them and exit 0 (SIGTERM or SIGINT end it sooner, as cleanly)."
)
SleepTimeOpt = Annotated[float, _sleep_time(_SLEEP_TIME_HELP)]
HoldTimeOpt = Annotated[
    float | None,
    _sleep_time(f"{_SLEEP_TIME_HELP} Default: until a signal.", show_default=False),
]
PushTimeoutOpt = Annotated[
    float,
    _opt(
        "--push-timeout",
        metavar="SECONDS",
        callback=at_least(1),
        panel=TRANSFER,
        help="Seconds one push may take (it fails with exit 4 past that; the job goes on), and "
        "the job's start.",
    ),
]

# -- the serve job's control socket ---------------------------------------------------------------

ControlSocketOpt = Annotated[
    str | None,
    _from_env(
        "--control-socket",
        "PATH",
        CONTROL_SOCKET_ENV,
        # (No square brackets: help text is Rich markup, where [..] is a style tag.)
        "Unix socket of this node's control endpoint. Default: serve-DIGEST.sock, named after "
        "the servers, in $XDG_RUNTIME_DIR/ckptctl/ or /tmp/ckptctl-UID/ ($CKPTCTL_SOCKET_DIR "
        "in place of both when set).",
        SERVE_JOB,
        show_default=False,
    ),
]


def _which_job(name: str, metavar: str, envvar: str, help: str) -> Any:
    """A client's flag (push, rollback, status, stop): which serve job on this node."""
    return _from_env(name, metavar, envvar, help, SERVE_JOB, show_default=False)


JobSocketOpt = Annotated[
    str | None,
    _which_job(
        "--control-socket",
        "PATH",
        CONTROL_SOCKET_ENV,
        "The serve job's control socket. Default: that of the job feeding --endpoint, or "
        "your only serve job on this node.",
    ),
]
FindEndpointOpt = Annotated[
    list[str] | None,
    _which_job(
        "--endpoint",
        "URL",
        ENDPOINT_ENV,
        "Talk to the serve job that feeds this server (where several run here).",
    ),
]
FindUdsOpt = Annotated[
    list[str] | None,
    _which_job(
        "--uds", "PATH", UDS_ENV, "Talk to the serve job that feeds the server on this Unix socket."
    ),
]

# -- --verify (ckptctl/weights_checker.py) -----------------------------------------------------------------

VerifyOpt = Annotated[
    bool,
    _opt(
        "--verify",
        panel=VERIFY,
        help="After the update, prove that the servers hold it, through SGLang's weights "
        "checker: the SHA-256 of every tensor where a server offers compare_checksum, else "
        "the same per-engine checksum on every server fed (SGLang >= 0.5.12, two or more "
        "servers). Exit 1 naming the tensors that differ; exit 3, before pushing, where it "
        "cannot be done.",
    ),
]
VerifyRoundTripOpt = Annotated[
    bool,
    _opt(
        "--verify-round-trip",
        panel=VERIFY,
        help="For the first update of a run, into a server started from this same checkpoint: "
        "snapshot its weights, reset them to random values, update, and have it compare "
        "(SGLang >= 0.5.12). Needs --reset-served-weights.",
    ),
]
ResetServedWeightsOpt = Annotated[
    bool,
    _opt(
        "--reset-served-weights",
        panel=VERIFY,
        help="Confirm --verify-round-trip: the server serves random weights from the reset "
        "until the update lands, and keeps them if the update fails.",
    ),
]

# -- observing the job: metrics of a serve job, a trace file, JSON log lines ----------------------


class LogFormatChoice(str, Enum):
    text = "text"
    json = "json"


MetricsPortOpt = Annotated[
    int | None,
    _opt(
        "--metrics-port",
        metavar="PORT",
        callback=at_least(1, 65535),
        show_default=False,
        panel=SERVE_JOB,
        help="Serve Prometheus metrics (pushes, their stages and bytes, the served version, the "
        "job's state) on this port, from global rank 0. Needs the metrics extra: pip install "
        "'ckptctl\\[metrics]'.",
    ),
]
MetricsHostOpt = Annotated[
    str,
    _opt(
        "--metrics-host",
        metavar="HOST",
        panel=SERVE_JOB,
        help="Address the metrics listen on (0.0.0.0: every interface; they are not "
        "authenticated).",
    ),
]
TraceOpt = Annotated[
    Path | None,
    _opt(
        "--trace",
        metavar="FILE",
        show_default=False,
        panel=OUTPUT,
        help="Write a timeline of the job's stages on every rank (Chrome trace-event JSON: "
        "open it in Perfetto or chrome://tracing). Replaces FILE only where it is a trace "
        "written before; refuses any other file.",
    ),
]
LogFormatOpt = Annotated[
    LogFormatChoice,
    _opt(
        "--log-format",
        metavar="FORMAT",
        panel=OUTPUT,
        help="text, or json: one JSON object per log line on stderr (time, rank, stage, "
        "message, figures), for log collectors.",
    ),
]


def use_log_format(out: Output, log_format: LogFormatChoice) -> None:
    """--log-format json: stderr as JSON lines from here on, and no live view."""
    if log_format == LogFormatChoice.json:
        from ckptctl.observe import logs

        logs.use_json()
        out.interactive = False


def want_trace(out: Output, trace: Path | None) -> None:
    """--trace FILE: checked now (exit 2 where it cannot be written); the job writes it."""
    if trace is not None:
        from ckptctl.observe import timeline

        timeline.request(trace, primary=out.is_primary)
