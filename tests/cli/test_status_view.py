"""`ckptctl status`'s human lines for the last command and a stage: sizes in the units the
rest of the output uses, and an ending named as `--history` names it."""

from __future__ import annotations

from ckptctl.cli.serve import describe_status


def _lines(**doc: object) -> list[str]:
    return describe_status({"state": "idle", "world_size": 2, **doc}, "/x.sock")


def test_the_last_push_in_the_units_of_its_size() -> None:
    last = {"ok": True, "seq": 3, "checkpoint_path": "/c", "total_bytes": 58_770, "wall_s": 0.5}
    assert any(
        line.startswith("last push 3: /c: ok in 0.50s (58.77 kB, 117.54 kB/s), at ")
        for line in _lines(last=last)
    ), _lines(last=last)


def test_a_failed_push_says_how_it_ended() -> None:
    base = {"ok": False, "seq": 4, "checkpoint_path": "/c", "error": "boom"}
    cases = [
        ({"exit_code": 130, "server_weights": None}, "cancelled (exit 130): boom"),
        ({"exit_code": 1, "server_weights": "whole"}, "failed, restored (exit 1): boom"),
        ({"exit_code": 3, "server_weights": None}, "refused before sending (exit 3): boom"),
        ({"exit_code": 1, "server_weights": "partial"}, "failed (exit 1): boom"),
    ]
    for fields, said in cases:
        lines = _lines(last={**base, **fields})
        assert f"last push 4: /c: {said}" in lines, lines


def test_a_stage_still_reading_shows_how_far_in_its_units() -> None:
    staged = {"seq": 5, "checkpoint_path": "/d", "bytes_read": 1_500_000, "share_bytes": 3_000_000}
    lines = _lines(staged=staged, rank=0)
    assert "staged for the next push: /d (stage 5; rank 0's share 1.50 MB of 3.00 MB read)" in lines


def test_a_push_refused_before_sending_is_shown_apart_while_it_is_the_latest() -> None:
    last = {"ok": True, "seq": 4, "checkpoint_path": "/c", "total_bytes": 1000, "wall_s": 0.5}
    refused = {"ok": False, "seq": 5, "checkpoint_path": "/typo", "exit_code": 3,
               "server_weights": None, "error": "no checkpoint"}  # fmt: skip
    lines = _lines(last=last, last_refused=refused)
    assert any(line.startswith("last push 4: /c: ok in 0.50s") for line in lines), lines
    assert "last push 5: /typo: refused before sending (exit 3): no checkpoint" in lines, lines
    later = _lines(last={**last, "seq": 6}, last_refused=refused)  # a push ran since
    assert not any("/typo" in line for line in later), later
