"""A user's cache in the style many tutorials teach: two preallocated buffers and a write
position, with no check of its input, so that bad input and overflow reach torch's own
errors (tests/test_failure_reports.py reads the kit's reports of them)."""

import torch


class UncheckedCache:
    def __init__(self, spec):
        self.spec = spec
        self.reset()

    @property
    def length(self):
        return self.position

    @property
    def nbytes(self):
        return self.keys.nbytes + self.values.nbytes

    def append(self, key, value):
        end = self.position + key.shape[2]
        self.keys[:, :, self.position : end] = key
        self.values[:, :, self.position : end] = value
        self.position = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def reset(self):
        s = self.spec
        shape = (s.batch, s.kv_heads, s.max_length, s.head_dim)
        self.keys = torch.zeros(shape, dtype=s.dtype, device=s.device)
        self.values = torch.zeros(shape, dtype=s.dtype, device=s.device)
        self.position = 0


class WrappingCache(UncheckedCache):
    """The same, its errors wrapped in one of its own: a chain two deep under the kit's."""

    def append(self, key, value):
        try:
            return super().append(key, value)
        except RuntimeError as error:
            raise RuntimeError("WrappingCache could not store the rows") from error
