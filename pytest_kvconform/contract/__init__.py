"""The contract's own terms, imported by every layer above: the clause table and its
grammar, the outcomes a check raises, the records, the cases, the independent oracle,
and the bounds any input is held to.  Stdlib and numpy only."""

# Version of contract.md (shipped in this package) that the clause ids refer to.  Reports of
# different contract versions are not merged.
CONTRACT_VERSION = "2"
