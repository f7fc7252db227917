"""How hard this repository's own kit classes search.

The default run (``pytest -n auto``, the README's quick start) gives each class a share of
the kit profile's examples, so that the whole suite stays within a minute on two cores: every
property, pinned input and edge still runs on every cache, on a few drawn examples. ``pytest
--soak`` gives each class the depth it is held at and runs the tests marked ``soak``
(``.ci/run`` runs it after the default run); the mutant hunt (tests/test_mutants.py)
searches in full in both.
"""

SOAK = False  # set from --soak by the root conftest.py, before any test module is imported


def pick(default: float, *, soak: float) -> float:
    """A class's share of the profile's examples (or a test's count of them): ``default``
    in the default run, ``soak`` under --soak."""
    return soak if SOAK else default


def written_for(*areas: type) -> tuple[type, ...]:
    """The kit classes a correct cache's test class inherits: in the default run the areas
    (``kvcheck.base``) the cache was written to exercise, under --soak every property
    (``CacheTests``). Chosen at import, which follows the root conftest's setting of SOAK."""
    from kvcheck import CacheTests

    return (CacheTests,) if SOAK else areas
