"""The outcomes a clause check raises besides passing (defined in ``outcomes``)."""

from __future__ import annotations

from pytest_kvconform.contract.outcomes import (
    ClauseFailure,
    ClauseSkip,
    ErrorKind,
    HarnessError,
    SkipKind,
    Unsupported,
)

__all__ = ["ClauseFailure", "ClauseSkip", "ErrorKind", "HarnessError", "SkipKind", "Unsupported"]
