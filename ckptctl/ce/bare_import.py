"""checkpoint-engine's modules, imported without running its package `__init__` first.

checkpoint_engine/__init__.py imports the package's HTTP API (fastapi, starlette, pydantic
models), which no rank uses, on every rank's critical path (and on that of every command that
reads or writes a metas file); the modules we use (ps, data_types, device_utils, worker) import
their siblings directly. So the package is entered as a bare module, and its `__init__` runs
when the package itself is first asked for a name, through a module `__getattr__` (PEP 562).
tests/torchrun/test_engine_internals.py fails when that stops holding.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Any

PACKAGE = "checkpoint_engine"
_lock = threading.RLock()


def engine_module(name: str) -> Any:
    """`checkpoint_engine.<name>`, the package's own `__init__` deferred (see above)."""
    with _lock:
        _enter_package()
    return importlib.import_module(f"{PACKAGE}.{name}")


def _enter_package() -> None:
    if PACKAGE in sys.modules:
        return  # imported already (whole, or bare by us): nothing to do
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return  # not installed as a package: the import below raises the usual error
    package = importlib.util.module_from_spec(spec)
    finished = threading.Event()

    def finish_init(name: str) -> Any:
        """The first name asked of the package: run its __init__ now, then answer."""
        with _lock:
            if not finished.is_set():
                finished.set()
                del package.__dict__["__getattr__"]
                spec.loader.exec_module(package)  # type: ignore[union-attr]
        try:
            return package.__dict__[name]
        except KeyError:
            raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}") from None

    package.__dict__["__getattr__"] = finish_init
    sys.modules[PACKAGE] = package


def is_bare(module: ModuleType | None = None) -> bool:
    """Whether the package's `__init__` has not run (for tests and benchmarks)."""
    module = module or sys.modules.get(PACKAGE)
    return module is not None and "__getattr__" in module.__dict__
