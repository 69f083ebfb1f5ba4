"""Option aliases shared by the commands, so a flag means the same everywhere.

Defaults of the seed-compatible flags are fixed by the CLI contract (SGLang's example script).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckptctl.cli._choices import EngineChoice, RegisterModeChoice, SplitChoice
from ckptctl.defaults import API_KEY_ENV, DEFAULT_ENDPOINT

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


# -- the GPU commands (update, save-metas, join) ------------------------------------------------

CheckpointPathOpt = Annotated[
    Path,
    typer.Option(
        "--checkpoint-path",
        help="Checkpoint directory: safetensors shards with model.safetensors.index.json, "
        "a single model.safetensors, or a directory of .safetensors files.",
        show_default=False,
    ),
]
CheckpointNameOpt = Annotated[
    str, typer.Option("--checkpoint-name", help="Name the checkpoint is registered under.")
]
EndpointsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--endpoint",
        help="Base URL of the inference server. Give it once per server group on this node "
        "(in group order) to feed several servers from one torchrun.",
        show_default=DEFAULT_ENDPOINT,
    ),
]
UdsListOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--uds",
        help="Unix socket of the inference server for every HTTP call; once per group like "
        "--endpoint.",
    ),
]
InferenceParallelSizeOpt = Annotated[
    int,
    typer.Option(
        "--inference-parallel-size",
        min=1,
        help="GPUs of each inference server (its TP size): ranks are grouped by it and the "
        "first rank of each group talks to that group's server.",
    ),
]
SplitOpt = Annotated[
    SplitChoice,
    typer.Option(
        "--split",
        help="files: whole files per rank; tensors: single tensors per rank; auto: "
        "whichever leaves the largest rank smaller (ties: files). Both balance bytes.",
    ),
]
VerboseOpt = Annotated[
    bool, typer.Option("--verbose", "-v", help="Also show checkpoint-engine's own log.")
]
RegisterModeOpt = Annotated[
    RegisterModeChoice,
    typer.Option(
        "--register-mode",
        help="How each rank's share reaches pinned memory. engine: checkpoint-engine copies it "
        "from the file mapping into buffers it allocates; direct: read straight into buffers "
        "pinned in place (less host memory; experimental).",
    ),
]
ReadThreadsOpt = Annotated[
    int | None,
    typer.Option(
        "--read-threads",
        min=1,
        max=256,
        help="Threads each rank reads its share with (--register-mode direct). "
        "Default: the CPU cores it may use over the ranks on its node, at most 16.",
        show_default=False,
    ),
]
ConsumeShmOpt = Annotated[
    bool,
    typer.Option(
        "--consume-shm-files",
        help="For a checkpoint a trainer wrote into /dev/shm to be consumed: checkpoint-engine "
        "pins each .safetensors file in place and DELETES it (no second copy in memory). The "
        "files are gone afterwards. Whole files per rank (--split files). Without this flag "
        "ckptctl never modifies or deletes checkpoint files.",
    ),
]
