"""A serve command (ckptctl.serve.commands.ServeCommand): parsed and bounded once,
where a client's request enters, in the bytes each string stands for; whatever it accepts
travels to every rank and is read back there the same. Issue 33 item 3: a 28 KB UTF-8 body
once became an 84,825-byte command that ended every rank, a push_id of 30,000 "é" the same,
and one nested 990 lists deep raised RecursionError on the other ranks."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from ckptctl.serve.commands import (
    ACTIONS,
    CLIENT_FIELDS,
    MAX_COMMAND_BYTES,
    MAX_SEQ,
    TEXT_BOUNDS,
    BadCommand,
    ServeCommand,
    push_id_of,
)


def refused(action: str, doc: object) -> str:
    with pytest.raises(BadCommand) as info:
        ServeCommand.from_request(action, doc)
    return str(info.value)


def test_the_widest_command_still_fits_in_one_tick() -> None:
    """Every string at its bound, in the characters JSON escapes widest (six bytes for each
    byte they stand for), every number at its largest: under MAX_COMMAND_BYTES, so that
    CommandChannel.tick never refuses a command the control socket took."""
    widest = {"\x01", "\udcff"}  # a control character; an undecodable byte of a path
    for char in widest:
        texts = {name: char * bound for name, bound in TEXT_BOUNDS.items()}
        texts["checkpoint_path"] = texts["trace"] = "/" + char * (TEXT_BOUNDS["trace"] - 1)
        command = ServeCommand(
            action="rollback", seq=MAX_SEQ - 1, restores=MAX_SEQ - 1,
            consume_shm_files=False, verify=False, allow_layout_change=False,
            pause="in_place", **texts,
        )  # fmt: skip
        data = command.to_json()
        assert len(data) <= MAX_COMMAND_BYTES, len(data)
        assert ServeCommand.from_json(data) == command
    # ...and no character escapes wider than those, for each byte it stands for.
    for char in ("é", "€", "😀", '"', "\\", "\udc80"):
        size = len(char.encode("utf-8", "surrogateescape"))
        assert len(json.dumps(char)) - 2 <= 6 * size, char


def test_every_string_is_bounded_in_bytes_not_characters() -> None:
    path = "/" + "é" * 3000  # 3001 characters, 6001 bytes
    assert "checkpoint_path must be a string of at most 4096 bytes" in refused(
        "push", {"checkpoint_path": path}
    )
    assert "push_id must be a string of at most 256 bytes" in refused(
        "push", {"checkpoint_path": "/c", "push_id": "é" * 30_000}
    )
    assert "push_id" in refused("push", {"checkpoint_path": "/c", "push_id": "é" * 129})
    ServeCommand.from_request("push", {"checkpoint_path": "/c", "push_id": "é" * 128})
    # The 28 KB body: every text field at its old bound of 1024 characters, 4 bytes each.
    doc = {"checkpoint_path": "/" + "😀" * 1024, "weight_version": "😀" * 1024}
    assert "at most 4096 bytes" in refused("push", doc)
    ServeCommand.from_request("push", {"checkpoint_path": "/c", "checkpoint_name": "😀" * 256})


def test_push_id_and_every_field_is_checked_for_its_type() -> None:
    deep: object = "x"
    for _ in range(990):
        deep = [deep]
    assert "push_id must be a string" in refused("push", {"checkpoint_path": "/c", "push_id": deep})
    assert "push_id must be a string" in refused("stage", {"checkpoint_path": "/c", "push_id": 7})
    for field in ("checkpoint_name", "weight_version", "trace"):
        assert f"{field} must be a string" in refused("push", {"checkpoint_path": "/c", field: []})
    for flag in ("consume_shm_files", "verify", "allow_layout_change"):
        assert f"{flag} must be true or false" in refused(
            "push", {"checkpoint_path": "/c", flag: None}
        )
    assert "unknown fields ['seq']" in refused("push", {"checkpoint_path": "/c", "seq": 5})
    assert "unknown fields ['verify']" in refused(
        "stage", {"checkpoint_path": "/c", "verify": True}
    )
    assert 'push needs {"checkpoint_path": DIR}' in refused("push", {"checkpoint_path": ""})
    assert "push needs a JSON object" in refused("push", [1])
    assert "trace must be an absolute path" in refused(
        "push", {"checkpoint_path": "/c", "trace": "t.json"}
    )
    assert "without NUL" in refused("push", {"checkpoint_path": "/c\x00/etc/passwd"})
    # A lone surrogate stands for no bytes; an undecodable byte of a path (surrogateescape) does.
    assert "checkpoint_path" in refused("push", {"checkpoint_path": "/\ud800"})
    ServeCommand.from_request("push", {"checkpoint_path": "/ckpt-\udcff"})
    # Unknown field names are shown short: an answer never repeats a huge body.
    assert len(refused("push", {"x" * 60_000: 1, "checkpoint_path": "/c"})) < 400


def test_rollback_and_cancel_take_a_bounded_push_id_alone() -> None:
    assert push_id_of(None, "rollback") is None
    assert push_id_of({"push_id": "abc"}, "cancel") == "abc"
    for doc in ({"push_id": ["x"]}, {"push_id": "é" * 200}, {"other": 1}, [1]):
        with pytest.raises(BadCommand):
            push_id_of(doc, "rollback")


def test_what_rank_0_sends_every_rank_reads_back_alike() -> None:
    """A bounded fuzz of what the control socket accepts: each command's JSON, read back by
    the other ranks' parser, is the same command, and fits in a tick."""
    rng = random.Random(33)
    alphabet = ["a", "/", "é", "€", "😀", "\x01", '"', "\\", "\udcff", " ", "\n"]
    accepted = 0
    for _ in range(2000):
        action = rng.choice(sorted(CLIENT_FIELDS))
        doc: dict[str, object] = {}
        for name in CLIENT_FIELDS[action]:
            if rng.random() < 0.5:
                continue
            if name in TEXT_BOUNDS:
                size = rng.choice([0, 1, 10, TEXT_BOUNDS[name] // 4, TEXT_BOUNDS[name]])
                text = "".join(rng.choice(alphabet) for _ in range(size))
                doc[name] = ("/" + text) if name in ("checkpoint_path", "trace") else text
            else:
                doc[name] = rng.choice([True, False, None, 1])
        if action == "rollback":
            continue  # (push_id_of, above)
        try:
            command = ServeCommand.from_request(action, doc)
        except BadCommand:
            continue
        accepted += 1
        command = dataclasses.replace(command, seq=rng.randrange(MAX_SEQ), started_at="now")
        data = command.to_json()
        assert len(data) <= MAX_COMMAND_BYTES
        assert ServeCommand.from_json(data) == command
    assert accepted > 100  # (the fuzz reached past the checks)


def test_the_other_ranks_refuse_what_is_not_a_command() -> None:
    good = json.loads(ServeCommand(action="push", checkpoint_path="/c").to_json())
    for data in (
        b"\xff",
        b"[" * 5000,
        json.dumps({**good, "extra": 1}).encode(),
        json.dumps({k: v for k, v in good.items() if k != "seq"}).encode(),
        json.dumps({**good, "action": "format-disk"}).encode(),
        json.dumps({**good, "seq": True}).encode(),
        json.dumps({**good, "restores": -1}).encode(),
        b" " * (MAX_COMMAND_BYTES + 1),
    ):
        with pytest.raises(BadCommand):
            ServeCommand.from_json(data)
    assert set(ACTIONS) == {*CLIENT_FIELDS, "restore"}


def test_a_push_s_pause_is_one_of_the_modes() -> None:
    """push --pause: a PauseMode's value or nothing (the job's own); anything else is refused
    at the socket (its engine's modes are the loop's to check: transfer/pausing.pause_refusal)."""
    assert ServeCommand.from_request("push", {"checkpoint_path": "/c", "pause": "keep"}).pause
    assert ServeCommand.from_request("push", {"checkpoint_path": "/c"}).pause is None
    for bad in ("bogus", "", 3, ["retract"], {"mode": "retract"}):
        assert "pause must be one of none, abort, retract" in refused(
            "push", {"checkpoint_path": "/c", "pause": bad}
        ), bad
    assert "unknown fields ['pause']" in refused(
        "stage", {"checkpoint_path": "/c", "pause": "abort"}
    )
