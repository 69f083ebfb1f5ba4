"""`ckptctl update --dry-run`: in-process (CliRunner), as the installed script, under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_factory import MALFORMED, write_sparse_checkpoint
from cli_run import ckptctl_script, invoke, run_script
from conftest import assert_failure_document
from model_shapes import qwen3_8b
from torchrun_launch import free_master_port

from ckptctl.checkpoint import plan_split, read_checkpoint

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny-checkpoint"


pytestmark = pytest.mark.usefixtures("plain_process")


def dry_run(*args: str, tp: int | None = None) -> list[str]:
    """One server spanning the whole world (TP = --world-size) unless `tp` says otherwise:
    the default TP8 would need a world of a multiple of 8."""
    world = args[args.index("--world-size") + 1] if "--world-size" in args else "1"
    return ["update", "--dry-run", "--inference-parallel-size", str(tp or world), *args]


def plan_fields(doc: dict) -> dict:
    """The dry run's document less the envelope, the server groups and the renamed count: the
    plan itself, as Plan.as_json() has it."""
    drop = {"ok", "exit_code", "error", "groups", "tensor_count", "warnings"}
    plan = {k: v for k, v in doc.items() if k not in drop}
    plan["total_tensors"] = doc["tensor_count"]
    return plan


def test_human_output_has_a_row_per_rank_and_a_summary() -> None:
    result = invoke(*dry_run("--checkpoint-path", str(TINY), "--world-size", "2"))
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    for column in ("rank", "files", "tensors", "bytes", "share", "vs even"):
        assert column in result.stdout
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == 3 and rows[0].split("│")[1].strip() == "0"  # two ranks, one group
    assert "server groups" in result.stdout and "http://localhost:19730" in rows[2]
    summary = lines[-1]
    assert "25 tensors in 3 file(s)" in summary and "over 2 rank(s)" in summary
    assert "lower bound" in summary


@pytest.mark.parametrize("split", ["auto", "files", "tensors"])
def test_json_is_the_plan(split: str) -> None:
    result = invoke(
        *dry_run("--checkpoint-path", str(TINY), "--world-size", "2", "--split", split, "--json")
    )
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)  # exactly one document, nothing else on stdout
    ckpt = read_checkpoint(TINY)
    assert doc["ok"] is True and doc["exit_code"] == 0 and doc["error"] is None
    assert plan_fields(doc) == plan_split(ckpt, 2, split).as_json()  # type: ignore[arg-type]
    assert doc["world_size"] == 2 and doc["total_bytes"] == ckpt.total_bytes
    if split != "auto":
        assert doc["split"] == split
    names = [n for r in doc["ranks"] for n in r["tensors"]]
    assert sorted(names) == sorted(t.name for t in ckpt.tensors)  # every mode lists tensors


def test_installed_script_prints_the_same_plan() -> None:
    done = run_script(*dry_run("--checkpoint-path", str(TINY), "--world-size", "3", "--json"))
    assert done.returncode == 0, done.stderr
    assert plan_fields(json.loads(done.stdout)) == plan_split(read_checkpoint(TINY), 3).as_json()


def test_sparse_qwen3_8b_plan(tmp_path: Path) -> None:
    root = write_sparse_checkpoint(tmp_path / "qwen3-8b", qwen3_8b())
    result = invoke(
        "update", "--dry-run", "--checkpoint-path", str(root), "--world-size", "8", "--json"
    )
    doc = json.loads(result.stdout)
    assert doc["total_bytes"] == 16_381_470_720
    assert sum(len(r["tensors"]) for r in doc["ranks"]) == 399
    assert doc["max_rank_bytes"] <= 1.02 * doc["total_bytes"] / 8


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_checkpoint_exits_3_with_one_line(tmp_path: Path, case: str) -> None:
    build, words = MALFORMED[case]
    path = build(tmp_path / "ckpt")
    result = invoke(*dry_run("--checkpoint-path", str(path), "--world-size", "2"))
    assert result.exit_code == 3
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert all(word in lines[0] for word in words)


def test_malformed_checkpoint_as_the_installed_script(tmp_path: Path) -> None:
    path = MALFORMED["header past end"][0](tmp_path / "ckpt")
    done = run_script(*dry_run("--checkpoint-path", str(path), "--json"))
    assert done.returncode == 3
    assert_failure_document(done.stdout, 3)
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1


def test_world_size_conflicting_with_torchrun_is_a_usage_error() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2"}
    args = dry_run("--checkpoint-path", str(TINY), "--json", tp=2)
    conflict = invoke(*args, "--world-size", "3", env=env)
    assert conflict.exit_code == 2 and "WORLD_SIZE=2" in conflict.stderr
    agree = invoke(*args, "--world-size", "2", env=env)
    assert agree.exit_code == 0 and json.loads(agree.stdout)["world_size"] == 2
    # Under torchrun only rank 0 prints the result.
    other = invoke(*args, env={"RANK": "1", "WORLD_SIZE": "2"})
    assert other.exit_code == 0 and other.stdout == ""


def test_default_world_is_one_process() -> None:
    result = invoke(*dry_run("--checkpoint-path", str(TINY), "--json"))
    doc = json.loads(result.stdout)
    assert doc["world_size"] == 1 and len(doc["ranks"]) == 1


def test_default_flags_plan_one_server_group() -> None:
    """The first command a newcomer types: no --world-size, the default TP8. The dry run plans
    one group of 8 ranks and says so, rather than refusing the defaults (exit 2)."""
    result = invoke("update", "--dry-run", "--checkpoint-path", str(TINY), "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["world_size"] == 8 and len(doc["ranks"]) == 8
    assert [g["ranks"] for g in doc["groups"]] == [list(range(8))]
    assert "planned one server group of 8 rank(s)" in result.stderr
    # An explicit --world-size is taken as given, with no note.
    given = invoke(*dry_run("--checkpoint-path", str(TINY), "--world-size", "2"))
    assert given.exit_code == 0 and "planned one server group" not in given.stderr


def test_missing_checkpoint_with_default_flags_is_invalid_input() -> None:
    """A path that does not exist is the error to report (exit 3), not the defaults' TP8."""
    result = invoke("update", "--dry-run", "--checkpoint-path", "/nope")
    assert result.exit_code == 3, result.stderr
    assert "error: /nope: does not exist" in result.stderr


def test_idle_ranks_name_their_cause(tmp_path: Path) -> None:
    """Ten tensors over four ranks, two of them huge: the ranks sit idle because of the huge
    ones, not because the checkpoint has fewer tensors than ranks; --json keeps the warning."""
    from ckpt_factory import sparse_file

    tmp_path.mkdir(exist_ok=True)
    big = [(f"big.{i}", "F32", [1024, 1024]) for i in range(2)]
    small = [(f"small.{i}", "F32", [16]) for i in range(8)]
    sparse_file(tmp_path / "model.safetensors", [*big, *small])
    args = dry_run("--checkpoint-path", str(tmp_path), "--world-size", "4")
    human = invoke(*args)
    assert human.exit_code == 0, human.stderr
    assert "fewer tensors than ranks" not in human.stderr
    assert "rank(s) get no tensors: the checkpoint's largest tensor (4.19 MB)" in human.stderr
    doc = json.loads(invoke(*args, "--json").stdout)
    idle = sum(1 for r in doc["ranks"] if not r["tensors"])
    assert idle and doc["warnings"] == [
        f"{idle} rank(s) get no tensors: the checkpoint's largest tensor (4.19 MB) is more "
        "than an even share (2.10 MB): the rank that holds it is the longest whatever the "
        "split, and the rest fit on fewer ranks"
    ]
    # Fewer tensors than ranks is still said so.
    few_args = dry_run("--checkpoint-path", str(tmp_path), "--world-size", "16", "--json")
    few = json.loads(invoke(*few_args).stdout)
    assert "the checkpoint has fewer tensors (10) than ranks (16)" in few["warnings"][0]


def test_bad_flags_are_usage_errors() -> None:
    assert invoke("update", "--dry-run").exit_code == 2  # no --checkpoint-path
    args = dry_run("--checkpoint-path", str(TINY))
    assert invoke(*args, "--split", "bytes").exit_code == 2
    assert invoke(*args, "--world-size", "0").exit_code == 2


@pytest.mark.no_cuda
@pytest.mark.parametrize(
    ("extra", "code", "words"),
    [
        # one process is a world of 1: a TP8 group cannot be formed
        (
            [],
            2,
            "--inference-parallel-size 8 needs 8 ranks, one per GPU of the server, and this job has one",
        ),
        (
            ["--inference-parallel-size", "1", "--world-size", "2"],
            2,
            "--world-size only goes with --dry-run",
        ),
        (
            ["--inference-parallel-size", "1", "--engine", "vllm", "--weight-version", "v1"],
            2,
            "vLLM",
        ),
        # p2p is refused before anything is loaded when mooncake/RDMA are missing
        (
            ["--inference-parallel-size", "1", "--update-method", "p2p"],
            3,
            "mooncake is not installed",
        ),
        (
            ["--inference-parallel-size", "1", "--update-method", "all"],
            3,
            "use --update-method broadcast",
        ),
        (["--inference-parallel-size", "1"], 1, "no CUDA device"),
    ],
)
def test_update_without_a_gpu_fails_early_and_clearly(
    extra: list[str], code: int, words: str
) -> None:
    result = invoke("update", "--checkpoint-path", str(TINY), "--timeout", "20", *extra)
    assert result.exit_code == code, result.stderr
    assert words in result.stderr
    assert "Traceback" not in result.stderr


def test_a_dry_run_refuses_a_metas_file_path_that_holds_the_users_file(tmp_path: Path) -> None:
    mine = tmp_path / "README.md"
    mine.write_text("mine")
    result = invoke(*dry_run("--checkpoint-path", str(TINY), "--save-metas-file", str(mine)))
    assert result.exit_code == 2, result.stderr
    assert "exists and is not a metas file ckptctl wrote" in result.stderr
    assert mine.read_text() == "mine"
    # Rank 0 writes it: another node's rank need not have its folder.
    elsewhere = dry_run(
        "--checkpoint-path", str(TINY), "--save-metas-file", "/nonexistent/m.json", tp=2
    )
    rank_1 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert invoke(*elsewhere, env=rank_1).exit_code == 0
    assert invoke(*elsewhere).exit_code == 2


def test_seed_flags_are_accepted(tmp_path: Path) -> None:
    metas = str(tmp_path / "m.json")
    result = invoke(
        *dry_run("--checkpoint-path", str(TINY), "--json", "--world-size", "2"),
        *("--endpoint", "http://localhost:1", "--inference-parallel-size", "2"),
        *("--checkpoint-name", "iter-7", "--update-method", "p2p", "--uds", "/tmp/x.sock"),
        *("--weight-version", "v7", "--sleep-time", "3", "--save-metas-file", metas),
        *("--timeout", "30", "-q"),
    )
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["world_size"] == 2
    assert doc["groups"] == [
        {
            "group": 0,
            "ranks": [0, 1],
            "leader": 0,
            "node": 0,
            "endpoint": "http://localhost:1",
            "uds": "/tmp/x.sock",
        }
    ]


def test_dry_run_does_not_import_torch() -> None:
    code = (
        "import sys\nfrom ckptctl.cli import app\n"
        "try:\n    app(sys.argv[1:], prog_name='ckptctl')\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *dry_run("--checkpoint-path", str(TINY), "--json")],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["world_size"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["--no-python", "-m"])
def test_torchrun_two_ranks_print_one_plan(launch: str) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    # `torchrun --no-python ckptctl ...` and `torchrun -m ckptctl ...` run the same CLI.
    program = [ckptctl_script()] if launch == "--no-python" else ["ckptctl"]
    cmd = [
        str(torchrun if torchrun.exists() else "torchrun"),
        *("--nproc-per-node", "2", "--master-port", str(free_master_port()), launch),
        *program,
        *dry_run("--checkpoint-path", str(TINY), "--json", tp=2),
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)  # fails if both ranks printed, or anything else did
    expected = invoke(*dry_run("--checkpoint-path", str(TINY), "--world-size", "2", "--json"))
    assert doc == json.loads(expected.stdout)  # (the groups too: LOCAL_WORLD_SIZE is 2)
    assert doc["world_size"] == 2


def test_tiny_example_is_what_its_script_writes(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "make_tiny_checkpoint.py"),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "25 tensors" in done.stdout
    committed = sorted(p.name for p in TINY.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == committed
    for name in committed:
        assert (tmp_path / name).read_bytes() == (TINY / name).read_bytes(), name
    dtypes = {t.dtype for t in read_checkpoint(TINY).tensors}
    assert {"BF16", "F32", "F8_E4M3", "I64", "BOOL"} <= dtypes
    assert any(t.shape == () for t in read_checkpoint(TINY).tensors)
