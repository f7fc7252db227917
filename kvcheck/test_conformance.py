"""Every property of the kit on the caches named with ``--kv-impl`` / ``KV_IMPL``:
``pytest -n auto --pyargs kvcheck --kv-impl mypkg.caches:MyCache`` needs no file of yours."""

from kvcheck import CacheTests


class TestConformance(CacheTests):
    pass
