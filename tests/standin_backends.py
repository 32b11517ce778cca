"""Stand-in backends for tests, defined once: source text for a pytester conftest, and the
same classes for tests that call the checks directly."""

from __future__ import annotations

# A conftest registering GOOD (declares False, as every in-tree backend) and INT_FLAG
# (declares the int 1: truthy, not a bool, which KV-L1 must report).
GOOD_AND_INT_FLAG_CONFTEST = '''
class Good:
    @classmethod
    def indexes_kv_by_block_stride(cls):
        return False

class IntFlag:
    @classmethod
    def indexes_kv_by_block_stride(cls):
        return 1

def pytest_kvconform_backends(config):
    return {"GOOD": Good, "INT_FLAG": IntFlag}
'''
