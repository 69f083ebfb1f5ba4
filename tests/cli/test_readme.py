"""The README's commands that need no GPU work as written: its dry runs, and its recipe that
tries `serve` on CPU (a stand-in SGLang server, a real two-rank serve job with only the
ParameterServer stood in), run by bash from the README's own text. Figures live in
bench/README.md, each with a results file that exists."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_script
from torchrun_launch import free_master_port

from ckptctl.defaults import DEFAULT_ENDPOINT

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BENCH_README = (ROOT / "bench" / "README.md").read_text()


def _block_after(heading: str) -> str:
    """The first ```sh block after `heading`."""
    start = README.index(heading)
    body = README.index("```sh\n", start) + len("```sh\n")
    return README[body : README.index("```", body)]


def _commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def test_the_two_set_up_commands_are_there_as_the_makefile_names_them() -> None:
    block = _block_after("## Set up and try it")
    assert [c[:2] for c in _commands(block)] == [["make", "demo"], ["make", "test"]]
    makefile = (ROOT / "Makefile").read_text()
    assert "\ndemo: setup\n" in makefile and "\ntest: setup\n" in makefile


def test_the_default_endpoint_is_the_one_the_readme_names() -> None:
    assert DEFAULT_ENDPOINT in README


def test_every_dry_run_in_the_readme_runs_as_written() -> None:
    runs = [c for c in _commands(_block_after("Preview the split")) if "--dry-run" in c]
    assert len(runs) == 3
    for cmd in runs:
        assert cmd[0] == "ckptctl"
        r = run_script(*cmd[1:], timeout=120, cwd=ROOT)
        assert r.returncode == 0, (cmd, r.stderr)
        assert r.stdout.strip(), cmd


@pytest.mark.slow
@pytest.mark.timeout(300)  # the recipe's `push --wait 120`, then the job's start and end
def test_the_serve_recipe_without_a_gpu_runs_as_written(tmp_path: Path) -> None:
    """The recipe, line by line, with two things moved so that it cannot meet another test:
    the stand-in server's port (and the endpoint with it) and torchrun's master port."""
    recipe = _block_after("### Try `serve` without a GPU")
    lines = recipe.splitlines()
    assert lines[0] == ". .venv/bin/activate"  # this interpreter's bin goes first on PATH instead
    server_port = free_master_port()
    master_port = free_master_port()
    while abs(master_port - server_port) < 2:
        master_port = free_master_port()
    script = "set -e\n" + "\n".join(lines[1:]).replace("19730", str(server_port))
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "CKPTCTL_ENDPOINT": f"http://localhost:{server_port}",
        "PET_MASTER_PORT": str(master_port),  # torchrun's --master-port
        "XDG_RUNTIME_DIR": str(tmp_path),
    }
    tmp_path.chmod(0o700)
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    assert out.count("pushed ") == 2 and "rolled back to push 1" in out, out[-4000:]
    assert "server weights: whole, from push 2" in out and "weight version demo-2" in out
    assert "ended: stopped by a client (ckptctl stop)" in out  # the job ended before bash did


def test_measured_figures_live_in_bench_readme_with_their_results_files() -> None:
    sentences = [s for s in re.split(r"(?<=\.)\s", README) if "H200" in s]
    assert len(sentences) <= 1 and "bench/README.md" in " ".join(sentences)
    cited = set(re.findall(r"`results/([\w.-]+\.(?:md|json|txt))`", BENCH_README))
    assert len(cited) >= 10
    missing = [name for name in cited if not (ROOT / "bench" / "results" / name).is_file()]
    assert not missing


def test_each_results_file_is_indexed_with_its_commit_date_and_machine() -> None:
    """bench/results holds one current file per benchmark, no logs; each is in the index (a
    .json beside the .md it goes with) and says where it was made."""
    results = ROOT / "bench" / "results"
    names = sorted(p.name for p in results.iterdir() if p.is_file())
    index = BENCH_README[BENCH_README.index("## Index") :]
    for name in names:
        assert re.fullmatch(r"[a-z0-9.-]+\.(md|json)", name), name
        stem = name.rsplit(".", 1)[0]
        assert f"`results/{name}`" in index or f"`results/{stem}.md`" in index, name
        text = (results / name).read_text()
        if name.endswith(".md"):
            assert text.split("\n")[2].startswith("Commit "), name
        else:
            made = json.loads(text)["provenance"]
            assert made["commit"] and made["date"] and made["machine"], name
