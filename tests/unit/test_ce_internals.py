"""ce/internals.py: the one module that touches checkpoint-engine's private attributes.

- It refuses a checkpoint-engine version it was not written for, with one line and exit 1,
  before anything private is touched (the installed version is faked with a distribution of
  that version ahead of the real one on sys.path, in a subprocess);
- its version helpers import neither torch nor checkpoint-engine (`ckptctl doctor`);
- a private attribute that is missing is named, not raised as an AttributeError;
- every private name it uses exists in the installed checkpoint-engine's ParameterServer;
- nothing else in ckptctl/ touches a private name of checkpoint-engine.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import run_script
from locations import ROOT as REPO
from locations import TINY

from ckptctl.ce import internals as ce_internals
from ckptctl.errors import OperationFailed


def _fake_distribution(root: Path, version: str) -> Path:
    """A checkpoint-engine distribution of `version` (metadata only): put ahead of the real one
    on sys.path, it is what importlib.metadata finds."""
    info = root / f"checkpoint_engine-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: checkpoint-engine\nVersion: {version}\n"
    )
    return root


def _env_with(fake: Path) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(fake), str(REPO), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("version", ["0.5.0", "0.4.1"])
def test_update_refuses_a_version_it_was_not_written_for_in_one_line(
    tmp_path: Path, version: str
) -> None:
    fake = _fake_distribution(tmp_path / "site", version)
    args = ["update", "--checkpoint-path", str(TINY), "--inference-parallel-size", "1"]
    # (--timeout is a bound, not a wait: the refusal comes as the parameter server starts)
    r = run_script(*args, "--timeout", "120", env=_env_with(fake), timeout=180)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert r.returncode == 1, r.stderr
    assert errors == [
        f"error: checkpoint-engine {version} is installed; ckptctl is written for "
        f"{ce_internals.WRITTEN_FOR} (pip install 'checkpoint-engine{ce_internals.WRITTEN_FOR}')"
    ], r.stderr
    assert "Traceback" not in r.stderr and "no CUDA device" not in r.stderr


def test_the_version_is_checked_before_any_private_access(tmp_path: Path) -> None:
    code = """
    from ckptctl.errors import OperationFailed
    from ckptctl.ce import internals as ce_internals
    print(ce_internals.installed_version())
    print(ce_internals.version_problem())
    try:
        ce_internals.device_uuid(object())  # would name the missing attribute if it got there
    except OperationFailed as exc:
        print(exc)
    """
    fake = _fake_distribution(tmp_path / "site", "0.5.0rc1")
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **_env_with(fake)},
    )
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 3, r.stderr
    assert lines[0] == "0.5.0rc1"
    assert lines[1] == lines[2] and lines[1].startswith("checkpoint-engine 0.5.0rc1 is installed")


def test_the_version_helpers_need_neither_torch_nor_checkpoint_engine() -> None:
    code = """
    import sys
    from ckptctl.ce.internals import WRITTEN_FOR, installed_version, version_problem
    assert isinstance(WRITTEN_FOR, str) and version_problem() is None, version_problem()
    assert installed_version()
    heavy = [m for m in ("torch", "checkpoint_engine", "zmq") if m in sys.modules]
    assert not heavy, heavy
    print("ok")
    """
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )
    assert r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.parametrize(
    ("version", "fits"),
    [
        ("0.4.2", True),
        ("0.4.2.post1", True),
        ("0.4.3.dev0", True),
        ("0.4.10+local", True),
        ("1!0.4.2", False),
        ("0.4.2rc1", False),
        ("0.4.1", False),
        ("0.4", False),
        ("0.5", False),
        ("0.5.0rc1", False),
        ("1.0.0", False),
        ("not-a-version", False),
    ],
)
def test_the_range_is_read_as_pep_440_reads_it(version: str, fits: bool) -> None:
    assert ce_internals._satisfies(version, ce_internals.WRITTEN_FOR) is fits


def test_a_missing_private_attribute_is_named() -> None:
    from ckptctl.ce.bare_import import engine_module

    ps = object.__new__(engine_module("ps").ParameterServer)  # (its constructor needs CUDA)
    with pytest.raises(OperationFailed, match=r"has no ParameterServer\._device_uuid, which"):
        ce_internals.device_uuid(ps)


def _engine_source() -> Path:
    spec = importlib.util.find_spec("checkpoint_engine")
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0])


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and len(name) > 2


def test_every_private_name_it_uses_is_the_installed_parameter_servers() -> None:
    tree = ast.parse((_engine_source() / "ps.py").read_text())
    server = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ParameterServer"
    )
    theirs = {n.name for n in server.body if isinstance(n, ast.FunctionDef)} | {
        n.attr for n in ast.walk(server) if isinstance(n, ast.Attribute) and _private(n.attr)
    }
    ours = {
        n.attr
        for n in ast.walk(ast.parse(Path(ce_internals.__file__).read_text()))
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "ps"
    }
    assert len(ours) >= 10 and ours <= theirs, sorted(ours - theirs)


def private_accesses(package: Path) -> list[str]:
    """Where a module of `package` other than ce/internals.py touches a private name of
    checkpoint-engine: an attribute of anything but its own `self`/`cls`, an import, or a name
    given as a string (getattr)."""
    names: set[str] = set()
    for path in _engine_source().rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    names = {n for n in names if _private(n)}
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == Path(ce_internals.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in names:
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue  # (our own classes' attributes: `self._rank`)
                hit = ast.unparse(node)
            elif isinstance(node, ast.alias) and node.name in names:
                hit = f"import {node.name}"
            elif isinstance(node, ast.Constant) and node.value in names:
                hit = repr(node.value)
            else:
                continue
            found.append(f"{path.relative_to(package.parent)}:{node.lineno}: {hit}")
    return sorted(found)


def test_no_private_attribute_of_checkpoint_engine_is_touched_outside_ce_internals() -> None:
    assert private_accesses(REPO / "ckptctl") == []
