"""Clause checks: one function per contract clause, no pytest inside.

A check returns None when its clause holds and raises :class:`ClauseFailure`
when it does not, or :class:`ClauseSkip` when it cannot run here (a missing
package, device or importable backend).  The pytest front-end
(``pytest_kvconform.suite``) and the plain Python API
(:func:`pytest_kvconform.api.check_backend`, which ``kvconform run`` drives) share
these functions, through the clause table (:mod:`pytest_kvconform.contract.clauses`).
"""

from __future__ import annotations

from pytest_kvconform.checks.errors import ClauseFailure, ClauseSkip, SkipKind

__all__ = ["ClauseFailure", "ClauseSkip", "SkipKind"]
