"""A user's cache whose reset clears the keys but not the values: a list of appended chunks,
concatenated on every append (tests/test_failure_reports.py)."""

import torch


class KeepsValuesCache:
    def __init__(self, spec):
        self.spec = spec
        self.keys = []
        self.values = []

    @property
    def length(self):
        return sum(k.shape[2] for k in self.keys)

    @property
    def nbytes(self):
        return sum(k.nbytes for k in self.keys) + sum(v.nbytes for v in self.values)

    def append(self, key, value):
        if key.shape != value.shape or key.ndim != 4 or key.shape[2] < 1:
            raise ValueError(f"bad key/value shapes {tuple(key.shape)} {tuple(value.shape)}")
        s = self.spec
        if key.shape[0] != s.batch or key.shape[1] != s.kv_heads or key.shape[3] != s.head_dim:
            raise ValueError(f"key shaped {tuple(key.shape)} does not fit the spec")
        if key.dtype != s.dtype or value.dtype != s.dtype or key.device != s.device:
            raise ValueError("wrong dtype or device")
        if self.length + key.shape[2] > s.max_length:
            raise ValueError("overflow")
        self.keys.append(key.clone())
        self.values.append(value.clone())
        return torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)

    def reset(self):
        self.keys = []  # the values are kept: the bug
