"""Legacy pickle metas files: read only with allow_pickle, and never run what a pickle names."""

from __future__ import annotations

import builtins
import copyreg
import io
import os
import pickle
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_engine.data_types import DataToGather, ParameterMeta
from cli_run import invoke, run_script
from conftest import assert_failure_document
from metas_samples import every_dtype_metas, small_metas

from ckptctl.errors import InvalidInput
from ckptctl.metas import legacy, read_metas_file
from ckptctl.metas.legacy import _admitted_globals, is_metas_pickle


def _payload_classes(marker: Path) -> list[type]:
    """Objects whose unpickling would create `marker`, each through a different callable."""
    cmd = f"touch {marker}"

    class OsSystem:
        def __reduce__(self) -> Any:
            return (os.system, (cmd,))

    class Popen:
        def __reduce__(self) -> Any:
            return (subprocess.Popen, (["touch", str(marker)],))

    class Eval:
        def __reduce__(self) -> Any:
            return (builtins.eval, (f"__import__('os').system({cmd!r})",))

    class Exec:
        def __reduce__(self) -> Any:
            return (builtins.exec, (f"import os; os.system({cmd!r})",))

    class Import:
        def __reduce__(self) -> Any:
            return (builtins.__import__, ("os",))

    class GetAttr:
        def __reduce__(self) -> Any:
            return (builtins.getattr, (str, "join"))

    return [OsSystem, Popen, Eval, Exec, Import, GetAttr]


def _hidden_in_metas(payload: object) -> dict:
    """A genuine metas dict with the payload tucked inside a ParameterMeta, as an attacker would."""
    metas = small_metas()
    metas[1].memory_buffer_metas_list[0].metas[0].__dict__["name"] = payload
    return metas


def _malicious_pickles(marker: Path) -> list[bytes]:
    pickles = []
    for cls in _payload_classes(marker):
        pickles.append(pickle.dumps(cls()))
        for proto in (0, 2, 5):
            pickles.append(pickle.dumps(_hidden_in_metas(cls()), protocol=proto))
    # Hand-written streams: protocol-0 GLOBAL and protocol-4 STACK_GLOBAL, no pickler involved.
    pickles.append(f"cposix\nsystem\n(V{'touch ' + str(marker)}\ntR.".encode())
    pickles.append(
        b"\x80\x04\x8c\x02os\x8c\x06system\x93\x8c"
        + bytes([len(f"touch {marker}")])
        + f"touch {marker}".encode()
        + b"\x85R."
    )
    return pickles


def test_real_pickles_of_every_protocol_round_trip(tmp_path: Path) -> None:
    metas = every_dtype_metas(world_size=32)
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        path = tmp_path / f"metas-{proto}.pkl"
        with path.open("wb") as f:
            pickle.dump(metas, f, protocol=proto)  # exactly what the seed script does
        got = read_metas_file(path, allow_pickle=True)
        assert got.metas == metas, proto
        assert got.legacy_pickle and got.checkpoint_name is None and got.world_size is None


def test_pickle_is_never_unpickled_without_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "metas.json"  # the extension does not matter: the content decides
    path.write_bytes(pickle.dumps(small_metas(), protocol=0))
    with pytest.raises(InvalidInput, match="legacy pickle.*--allow-pickle"):
        read_metas_file(path)


def test_admitted_globals_are_exactly_what_real_pickles_use() -> None:
    """Record every global real get_metas() pickles name: the allow-list holds no more."""
    used: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            used.add((module, name))
            return super().find_class(module, name)

    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        Recorder(io.BytesIO(pickle.dumps(every_dtype_metas(), protocol=proto))).load()
    admitted = {k for k, v in _admitted_globals().items() if not isinstance(v, torch.dtype)}
    assert admitted == {k for k in used if not (k[0] == "torch" and k[1] != "Size")}


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_malicious_pickles_never_run(tmp_path: Path, allow_pickle: bool) -> None:
    marker = tmp_path / "pwned"
    pickles = _malicious_pickles(marker)
    # The payloads are live: plain pickle.loads of the first one creates the marker.
    pickle.loads(pickles[0])
    assert marker.exists()
    marker.unlink()

    for i, data in enumerate(pickles):
        path = tmp_path / f"evil-{i}.pkl"
        path.write_bytes(data)
        expected = "refused to unpickle" if allow_pickle else "--allow-pickle"
        with pytest.raises(InvalidInput, match=expected):
            read_metas_file(path, allow_pickle=allow_pickle)
        assert not marker.exists(), f"pickle {i} ran its payload"


def test_refusal_names_the_global(tmp_path: Path) -> None:
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps(_hidden_in_metas(_payload_classes(tmp_path / "x")[0]())))
    with pytest.raises(InvalidInput, match=r"references (posix|os)\.system"):
        read_metas_file(path, allow_pickle=True)


def test_extension_registry_opcodes_are_refused_too(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "ext.pkl"
    # Registered while it is read too: the registry only names the global, find_class decides.
    copyreg.add_extension(os.system.__module__, "system", 0xC4C4)
    try:
        data = pickle.dumps(_payload_classes(marker)[0](), protocol=2)
        assert b"\x83" in data and b"system" not in data  # EXT2 opcode, no GLOBAL
        path.write_bytes(data)
        with pytest.raises(InvalidInput, match="refused to unpickle"):
            read_metas_file(path, allow_pickle=True)
    finally:
        copyreg.remove_extension(os.system.__module__, "system", 0xC4C4)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        # Classes a metas pickle never holds, even harmless ones.
        ({0: DataToGather(**small_metas()[0].__dict__, host_ip="h", device_uuid="u")}, "refused"),
        ({0: torch.zeros(2)}, "refused"),
        ({0: __import__("collections").OrderedDict()}, "refused"),
        # Admitted classes, wrong structure: the JSON validator's checks apply.
        ([small_metas()[0]], "expected a dict keyed by owner rank"),
        ({"0": small_metas()[0]}, "expected a dict keyed by owner rank"),
        ({0: "hello"}, "invalid metas"),
        ({0: (1, 2)}, "unexpected tuple object"),
        (
            {0: ParameterMeta(name="x", dtype=torch.int8, shape=torch.Size([1]), aligned_size=256)},
            "invalid metas",
        ),
    ],
)
def test_wrong_contents_are_refused(tmp_path: Path, obj: object, message: str) -> None:
    path = tmp_path / "m.pkl"
    path.write_bytes(pickle.dumps(obj))
    with pytest.raises(InvalidInput, match=message):
        read_metas_file(path, allow_pickle=True)


def test_shared_and_cyclic_objects_are_refused(tmp_path: Path) -> None:
    # Shared references let a tiny pickle describe an exponentially large tree.
    layer: list[Any] = []
    for _ in range(60):
        layer = [layer, layer]
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    for i, obj in enumerate(({0: {"memory_buffer_metas_list": layer}}, {0: cyclic})):
        path = tmp_path / f"m{i}.pkl"
        path.write_bytes(pickle.dumps(obj))
        assert path.stat().st_size < 2000
        with pytest.raises(InvalidInput, match="shared or cyclic"):
            read_metas_file(path, allow_pickle=True)


def test_truncated_padded_and_persistent_id_pickles(tmp_path: Path) -> None:
    data = pickle.dumps(small_metas())
    cases = {
        "truncated": (data[: len(data) // 2], "not a readable metas pickle"),
        "padded": (data + b"\x00junk", "unexpected data after the end"),
        "persid": (b"\x80\x02X\x01\x00\x00\x00aQ.", "BINPERSID opcode"),
        # A length field far beyond the file: refused before anything is allocated.
        "huge": (b"\x80\x05\x96" + (2**62).to_bytes(8, "little") + b"ab.", "not a readable"),
        # LONG_BINPUT 2**30: the C unpickler would size its memo array to match (8+ GiB).
        "memo": (b"\x80\x04N" + b"r" + (2**30).to_bytes(4, "little") + b".", "memo index"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(InvalidInput, match=message):
            read_metas_file(path, allow_pickle=True)


def test_the_seed_scripts_pickle_is_told_from_its_opcodes_never_unpickled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """is_metas_pickle (may ckptctl replace this file?) reads opcodes only: with every way to
    unpickle taken away, it still knows the seed script's pickles of every protocol, and no
    other pickle: a malicious one, one padded or cut, metas beside another class."""
    marker = tmp_path / "pwned"
    seeds = [pickle.dumps(every_dtype_metas(), protocol=p) for p in range(6)]
    others = [
        *_malicious_pickles(marker),
        seeds[5] + b"\x00junk",
        seeds[5][:-1],
        pickle.dumps({**small_metas(), 9: torch.zeros(2)}),
        pickle.dumps([small_metas()]),
        pickle.dumps({"lr": 0.1}),
    ]

    def unpickled(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("unpickled")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, unpickled)
    monkeypatch.setattr(legacy, "_RestrictedUnpickler", unpickled)
    assert all(is_metas_pickle(data) for data in seeds)
    assert not any(is_metas_pickle(data) for data in others)
    assert not marker.exists()


def test_a_huge_integer_is_invalid_input_never_an_internal_error(tmp_path: Path) -> None:
    """An integer of over 4300 digits cannot be turned into text (ValueError): wherever one
    sits in a pickle read with --allow-pickle, the CLI says so in one line, exit 3."""
    huge = 10**5000
    plain = {k: v.model_dump(mode="json") for k, v in small_metas().items()}
    buffer = plain[0]["memory_buffer_metas_list"][0]
    size_object = small_metas()
    object.__setattr__(
        size_object[0].memory_buffer_metas_list[0].metas[0], "shape", torch.Size([huge])
    )
    cases = {
        "rank": {-huge: plain[0]},
        "address": {0: {**plain[0], "memory_buffer_metas_list": [{**buffer, "ptr": huge}]}},
        "torch.Size": size_object,
    }
    for name, obj in cases.items():
        path = tmp_path / f"{name}.pkl"
        path.write_bytes(pickle.dumps(obj))
        result = invoke("inspect-metas", str(path), "--allow-pickle")
        assert result.exit_code == 3, (name, result.output)
        assert result.stderr.count("\n") == 1, result.stderr
        assert "an integer beyond 64 bits" in result.stderr


def test_cli_refuses_malicious_pickle_with_and_without_the_flag(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "metas.pkl"
    path.write_bytes(pickle.dumps(_hidden_in_metas(_payload_classes(marker)[0]())))
    for flags in ([], ["--allow-pickle"]):
        result = invoke("inspect-metas", str(path), *flags)
        assert result.exit_code == 3, result.output
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
        proc = run_script("inspect-metas", str(path), "--json", *flags)
        assert proc.returncode == 3
        assert_failure_document(proc.stdout, 3)
        assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
        assert not marker.exists()


def test_mutated_files_are_read_or_refused_quietly(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Random damage to real files: a valid result or InvalidInput, nothing else, no noise.

    (This found a BYTEARRAY8 length that made the C unpickler print a SystemError to fd 2,
    and a LONG_BINPUT index that made it allocate gigabytes for 30 s.)
    """
    import random

    rng = random.Random(1)
    seeds = [pickle.dumps(small_metas(), protocol=p) for p in range(6)]
    path = tmp_path / "m"
    read = refused = 0
    for _ in range(1500):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(data))
            if rng.random() < 0.6:
                data[pos] = rng.randrange(256)
            else:
                data[pos : pos + rng.randint(1, 20)] = b""
        path.write_bytes(bytes(data))
        try:
            read_metas_file(path, allow_pickle=True)
            read += 1
        except InvalidInput:
            refused += 1
    assert read > 0 and refused > 0
    assert capfd.readouterr().err == ""
