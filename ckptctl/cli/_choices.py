"""Enumerated flag values (Typer shows them in --help and completes them); --update-method's
is the request's own UpdateMethod (transfer/request.py)."""

from __future__ import annotations

from enum import Enum


class EngineChoice(str, Enum):
    sglang = "sglang"
    vllm = "vllm"


class ReadyCondition(str, Enum):
    listening = "listening"
    healthy = "healthy"


class SplitChoice(str, Enum):
    auto = "auto"
    files = "files"
    tensors = "tensors"


class RegisterModeChoice(str, Enum):
    engine = "engine"
    direct = "direct"
