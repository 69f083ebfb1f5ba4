"""checkpoint-engine as ckptctl was written for it: the version range, read without torch.

`WRITTEN_FOR` is the range pyproject.toml declares; `version_problem()` says, in one line, why
the installed distribution is not one ckptctl works with (None when it is).
"""

from __future__ import annotations

import importlib.metadata
import re

DISTRIBUTION = "checkpoint-engine"
WRITTEN_FOR = ">=0.4.2,<0.5"

_CLAUSE = re.compile(r"\s*(>=|<=|==|!=|>|<)\s*([0-9][0-9.]*)\s*")


def installed_version() -> str | None:
    """The installed checkpoint-engine's version; None when it is not installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version ("0.4.2.post1+cu12" -> (0, 4, 2)), padded for comparing."""
    numbers = re.match(r"\d+(?:\.\d+)*", version.strip().lstrip("v"))
    parts = tuple(int(n) for n in numbers.group(0).split(".")) if numbers else (0,)
    return parts + (0,) * (4 - len(parts))


def _satisfies(version: str, specifier: str) -> bool:
    have = _release(version)
    tests = {
        ">=": lambda want: have >= want,
        "<=": lambda want: have <= want,
        ">": lambda want: have > want,
        "<": lambda want: have < want,
        "==": lambda want: have == want,
        "!=": lambda want: have != want,
    }
    for clause in specifier.split(","):
        found = _CLAUSE.fullmatch(clause)
        if found is None:
            raise ValueError(f"unsupported version clause {clause!r}")
        if not tests[found.group(1)](_release(found.group(2))):
            return False
    return True


def version_problem() -> str | None:
    """Why the installed checkpoint-engine will not do (not installed, out of range); else None."""
    version = installed_version()
    want = f"pip install '{DISTRIBUTION}{WRITTEN_FOR}'"
    if version is None:
        return f"{DISTRIBUTION} is not installed: {want}"
    if not _satisfies(version, WRITTEN_FOR):
        return (
            f"{DISTRIBUTION} {version} is installed; ckptctl was written for {WRITTEN_FOR}: {want}"
        )
    return None
