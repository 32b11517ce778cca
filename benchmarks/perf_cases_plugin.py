"""Benchmark-only pytest plugin: let KV-A run on bench_goals.py's ``perf_NN`` cases too.

The suite runs KV-A on ``clauses.A_CASES`` only; the "each extra adoption case"
goal (bench_goals.py) needs 40 world-size-1 cases through the same tests, so this widens that tuple.
Loaded with ``-p perf_cases_plugin`` (benchmarks/ on ``PYTHONPATH``); never by users.
"""

from __future__ import annotations

from pytest_kvconform.contract import clauses

clauses.A_CASES = (*clauses.A_CASES, *(f"perf_{i:02d}" for i in range(40)))
