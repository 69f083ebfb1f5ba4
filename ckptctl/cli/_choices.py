"""--register-mode's choices: engine and direct (consume is asked for with its own flag,
--consume-shm-files, as it deletes files)."""

from __future__ import annotations

from enum import Enum


class RegisterModeChoice(str, Enum):
    engine = "engine"
    direct = "direct"
