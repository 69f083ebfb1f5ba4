"""A metas file is written where the user says, over nothing of theirs: a CPU `save-metas`
job under torchrun whose --metas-file names the user's own file fails on rank 0 before it
reads the checkpoint, with exit 2, and leaves the file as it was (the other ranks, which
hold their shares for joiners until told, end with it)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import CPU_PS_RANK
from fake_server import run_torchrun
from locations import TINY


def test_save_metas_refuses_to_write_over_a_file_that_is_not_a_metas_file(tmp_path: Path) -> None:
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    r = run_torchrun(
        CPU_PS_RANK, "save-metas", "--checkpoint-path", str(TINY), "--metas-file", str(mine),
        "--json",
    )  # fmt: skip
    assert r.returncode != 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2, doc
    assert "exists and is not a metas file ckptctl wrote" in doc["error"], doc["error"]
    assert "[rank 0] register" not in r.stderr  # (refused before it read anything)
    assert mine.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
