"""``kvconform selftest``: does the suite still catch the known production faults here?

For each fault of the registry (``faults/registry.py``), one at a time and in a
fresh process: seed it into the installed stack, run the checks of the clauses that guard
it (:func:`~pytest_kvconform.api.check_backend`: the suite's checks and its one outcome
rule), and call it **caught** when one of their results fails that passes on the clean
install.  The clean baseline runs once per selection (corrections, backend, cases, with the
clauses of every fault that runs there), in a process of its own too.  A fault the
installed version cannot take (its module does not import, the statement it rewrites is
gone, the backend its checks run on does not import) is **unseedable**, with the reason; it
is never counted caught.

- ``runner.py``: the command's process: the stack imported once, which faults can be
  seeded, the baselines, :func:`~pytest_kvconform.selftest.runner.run`;
- ``forked.py``: each run in a child forked from that process, and its lifetime;
- ``verdict.py``: caught, missed, unseedable or error, and the account (text, JSON).
"""
