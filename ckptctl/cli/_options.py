"""Option aliases shared by the commands, so a flag means the same everywhere.

Defaults of the seed-compatible flags are fixed by the CLI contract (SGLang's example script).
"""

from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.cli._choices import EngineChoice
from ckptctl.server import API_KEY_ENV

JsonOpt = Annotated[
    bool,
    typer.Option("--json", help="Print exactly one JSON document on stdout; logs go to stderr."),
]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="No logs or progress; errors still go to stderr.")
]
EndpointOpt = Annotated[
    str,
    typer.Option(
        "--endpoint",
        help="Base URL of the inference server (with --uds only the path and Host matter).",
        show_default=True,
    ),
]
UdsOpt = Annotated[
    str | None,
    typer.Option("--uds", help="Unix socket of the inference server, used for every HTTP call."),
]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar=API_KEY_ENV,
        help="Bearer token for the server (SGLang --api-key/--admin-api-key, vLLM --api-key). "
        "Prefer the environment variable: a flag shows in the process list. Never printed.",
        show_default=False,
        show_envvar=True,
    ),
]
EngineOpt = Annotated[
    EngineChoice,
    typer.Option("--engine", help="Which server speaks at the endpoint."),
]
WeightVersionOpt = Annotated[
    str | None,
    typer.Option("--weight-version", help="Weight version string (SGLang records and reports it)."),
]
TimeoutOpt = Annotated[
    float,
    typer.Option("--timeout", min=0.0, help="Give up after this many seconds (exit 4)."),
]

DEFAULT_ENDPOINT = "http://localhost:19730"
