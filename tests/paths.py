"""The repository's root, for tests at any depth under ``tests/`` (``ROOT / "docs"``, ...)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
