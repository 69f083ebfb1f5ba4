"""Enumerated flag values (Typer shows them in --help and completes them)."""

from __future__ import annotations

from enum import Enum


class EngineChoice(str, Enum):
    sglang = "sglang"
    vllm = "vllm"


class ReadyCondition(str, Enum):
    listening = "listening"
    healthy = "healthy"
