"""The session events, one unit per event or closely tied family (``base`` says what a unit
is): ``feed``, ``feed_rows``, ``truncate``, ``reorder``, ``fork``, ``reset`` (poison, reset,
drop), ``shift`` (the whole batch's and each row's), ``rows`` (truncate, select, join and
reset by row), ``prefix`` (lookup, declare), ``offload`` (offload, restore), ``move``."""
