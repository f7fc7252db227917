"""The session engine (``kvcheck.session.engine``) and what its callers import with it.

Layout: ``request`` (a history on a set of caches: the books), ``engine`` (the requests, the
dispatch of events, what holds after every event), ``events`` (one unit per event or family:
its calls on the caches, its update of the books, its checks), ``checks`` (the checks several
events share), ``shifted`` (the oracle after a context shift), ``compare`` (logits against
the oracle's, and the diagnosis of a difference), ``pairs`` (the pair of events each event
completes, noted for the verdict), ``heap`` (collections kept to a session).
"""

from kvcheck.session.compare import (
    ATTEND_PATH_FACTOR,
    assert_logits,
    diagnose,
    first_wrong_layer,
    row_said,
)
from kvcheck.session.engine import Engine
from kvcheck.session.heap import young_objects_only
from kvcheck.session.request import Request

__all__ = [
    "ATTEND_PATH_FACTOR",
    "Engine",
    "Request",
    "assert_logits",
    "diagnose",
    "first_wrong_layer",
    "row_said",
    "young_objects_only",
]
