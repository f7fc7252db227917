"""Independently written, correct key/value caches used as evidence against false alarms.

Each module holds one cache written in its own style (storage, validation, error wording), as an
outside engineer would write it against DESIGN.md section 2 without using ``kvref.check_append``
or reading the suite's bad-input tables. All four keep the contract, so the suite must pass
each of them; any failure the suite reports for them is a false alarm of the suite.
"""
