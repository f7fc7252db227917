"""Independently written, correct key/value caches used as evidence against false alarms.

Each module holds one cache written in its own style (storage, validation, error wording),
as an outside engineer would write it against the contract (docs/contract.md), without
``kvref.check_append`` and without reading the suite's bad-input tables. Every one keeps the
contract, so the suite must pass each of them; any failure it reports for them is a false
alarm of the suite.
"""
