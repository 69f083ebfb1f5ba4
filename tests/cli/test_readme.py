"""The README's commands that need no GPU work as written: its dry runs (and those of docs/*.md),
and its recipe that tries `serve` on CPU (a stand-in SGLang server, a real two-rank serve job
with only the ParameterServer stood in), run by bash from the README's own text. A figure the
README quotes says what it was measured against and is one of bench/README.md's, each of which
has a results file that exists."""

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
# (docs/cli.md is the CLI's help, whose examples name DIR and URL: not runnable as they stand)
DOCS = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "cli.md"}
BENCH_README = (ROOT / "bench" / "README.md").read_text()


def _block_after(heading: str) -> str:
    """The first ```sh block after `heading`."""
    start = README.index(heading)
    body = README.index("```sh\n", start) + len("```sh\n")
    return README[body : README.index("```", body)]


def _sh_blocks(text: str) -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M)


def _commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def test_the_two_set_up_commands_are_there_as_the_makefile_names_them() -> None:
    block = _block_after("## Install and try it")
    assert [c[:2] for c in _commands(block)] == [["make", "demo"], ["make", "test"]]
    makefile = (ROOT / "Makefile").read_text()
    assert "\ndemo: setup\n" in makefile and "\ntest: setup\n" in makefile


def test_the_default_endpoint_is_the_one_the_readme_names() -> None:
    assert DEFAULT_ENDPOINT in README


def test_every_dry_run_in_the_readme_and_the_docs_runs_as_written() -> None:
    blocks = [b for text in [README, *DOCS.values()] for b in _sh_blocks(text)]
    runs = [c for b in blocks for c in _commands(b) if c[:1] == ["ckptctl"] and "--dry-run" in c]
    assert len(runs) >= 4  # the README's, and docs/update.md's three
    for cmd in runs:
        assert cmd[0] == "ckptctl"
        r = run_script(*cmd[1:], timeout=120, cwd=ROOT)
        assert r.returncode == 0, (cmd, r.stderr)
        assert r.stdout.strip(), cmd


@pytest.mark.slow
@pytest.mark.timeout(300)  # the recipe's `push --wait 120`, then the job's start and end
def test_the_serve_recipe_without_a_gpu_runs_as_written(tmp_path: Path) -> None:
    """The recipe, line by line, with three things moved so that it cannot meet another test:
    the stand-in server's port (and the endpoint with it), torchrun's master port, and the serve
    job's log (into this test's folder, not the repository's)."""
    recipe = _block_after("### Try `serve` without a GPU")
    lines = recipe.splitlines()
    assert lines[0] == ". .venv/bin/activate"  # this interpreter's bin goes first on PATH instead
    assert "> serve.log 2>&1 &" in recipe  # (the job's log apart from the commands' output)
    server_port = free_master_port()
    master_port = free_master_port()
    while abs(master_port - server_port) < 2:
        master_port = free_master_port()
    serve_log = tmp_path / "serve.log"
    script = "set -e\n" + "\n".join(lines[1:]).replace("19730", str(server_port))
    script = script.replace("serve.log", shlex.quote(str(serve_log)))
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
    log = serve_log.read_text() if serve_log.exists() else "(no serve.log)"
    assert proc.returncode == 0, out[-4000:] + log[-4000:]
    assert out.count("pushed ") == 2 and "rolled back to push 1" in out, out[-4000:]
    assert "server weights: whole, from push 2" in out and "weight version demo-2" in out
    # The job's own lines are in its log, not between the commands' output; its last lines,
    # shown by the recipe's `tail` once the job has ended, say how it ended.
    assert "planning the split" in log and "planning the split" not in out, out[-4000:]
    tail = out.rstrip().splitlines()[-3:]
    assert any("ended: stopped by a client (ckptctl stop)" in line for line in tail), tail


def test_a_figure_says_what_it_was_measured_against_and_is_one_of_bench_readmes() -> None:
    """A paragraph that quotes a measurement (on an H200) names the client, the server, the page
    cache and the TP size, links bench/README.md, and quotes its figures as bench/README.md
    does; the README has one such paragraph."""
    pages = {"README.md": README, **DOCS}
    quoting = {(name, p) for name, text in pages.items() for p in text.split("\n\n") if "H200" in p}
    assert [name for name, _ in quoting].count("README.md") == 1
    for name, paragraph in quoting:
        said = " ".join(paragraph.split())
        clients = ("ckptctl.client.push", "`ckptctl push`", "ckptctl update`")
        assert any(client in said for client in clients), (name, "which client")
        assert "receiver" in said and re.search(r"\b(warm|cold) page cache", said), name
        assert re.search(r"\bTP\d", said) and "bench/README.md" in said, name
        figures = re.findall(r"\d+\.\d+ (?:s|GB)\b", said)
        assert figures and all(f in BENCH_README for f in figures), (name, figures)
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
