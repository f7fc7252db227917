"""Which rows of their own may be in codes (contract, section 10.1, "everywhere a row is
compared"): each batch row counts its own recent run, and keeps its count through
``truncate_rows``, ``select_rows`` and ``join``. No built-in coded cache keeps a recent run
per row yet, so the recorder's book is held here directly."""

import torch

from kvcheck.harness import Recorder
from kvref import Quantized


class _RowsStub:
    """Takes rows of their own and returns nothing the recorder reads: its book is the test."""

    kv_storage = Quantized(bits=8, recent=2)
    padding = "right"

    def append_rows(self, key, value, counts):
        return None

    def truncate_rows(self, lengths):
        pass

    def select_rows(self, indices):
        pass

    def join(self, other):
        pass


def _feed(recorder: Recorder, counts: list[int]) -> None:
    width = max(counts)
    rows = torch.zeros((len(counts), 1, width, 2), dtype=torch.float64)
    recorder.append_rows(rows, rows.clone(), counts)


def test_each_row_counts_its_own_recent_run():
    recorder = Recorder(_RowsStub())
    _feed(recorder, [5, 1])
    assert recorder.rows_below == [[3, 3], [0, 0]]  # row 1's one row is recent, not row 0's
    _feed(recorder, [0, 4])
    assert recorder.rows_below == [[3, 3], [3, 3]]


def test_a_rollback_keeps_rows_in_codes_and_moves_carry_their_count():
    recorder = Recorder(_RowsStub())
    _feed(recorder, [6, 3])
    recorder.truncate_rows([2, 3])
    assert recorder.rows_below == [[2, 2], [1, 1]]  # precision does not come back
    _feed(recorder, [1, 0])
    assert recorder.rows_below == [[2, 2], [1, 1]]  # 3 held, 2 recent: 1 new in codes, 2 kept
    recorder.select_rows(torch.tensor([1, 0]))
    assert recorder.rows_below == [[1, 1], [2, 2]]
    other = Recorder(_RowsStub())
    _feed(other, [4])
    recorder.join(other)
    assert recorder.rows_below == [[1, 1], [2, 2], [2, 2]]
