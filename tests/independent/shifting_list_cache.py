"""A list-of-tokens cache with a llama.cpp-style context shift, keys re-rotated in its own dtype.

``ShiftingListCache`` keeps every token as its own pair of small tensors, (B, H_kv, D) each,
in two Python lists, oldest first; ``append`` stacks them along the length axis on return. A
context shift (contract, section 8.4) deletes a slice of those lists and re-rotates the keys
after it by -count positions.

How it differs from the built-in preallocated cache: nothing is preallocated (``nbytes`` is
the storage of the token tensors held, no spare room), every edit is a list operation, and the
re-rotation is written here from the RoPE convention and computed in the cache's storage dtype
rather than in float64 and rounded once:

- the rotation itself (x1 * cos - x2 * sin, x1 * sin + x2 * cos over the two halves of the
  head dimension) runs in the storage dtype, each product and sum rounded there;
- cos and sin come from float32 for float32, bfloat16 and float16 (rounded into the storage
  dtype for the half ones), the angle count x base ** (-2i / D) formed in float32 as llama.cpp
  forms it, and from float64 only for a float64 cache.

The float32 angle rounds with its size (some count x 1e-7 radians), which the kit's budget for
a shift allows (``kvcheck.asserts.shift_rounding``): this cache is how that budget is held to
what a plain implementation does.
"""

from __future__ import annotations

import torch
from torch import Tensor

import kvref

Pair = tuple[Tensor, Tensor]


def _cos_sin(head_dim: int, base: float, delta: int, dtype: torch.dtype, device) -> Pair:
    """cos and sin for a rotation by ``delta`` positions, in ``dtype`` on ``device``."""
    if dtype == torch.float64:
        # The storage dtype is float64: form the angles the way the reference model does,
        # (2i)/D, base ** -that, times the position, so that they are its angles exactly.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device)
        angles = torch.tensor(float(delta), dtype=torch.float64, device=device) * (
            base ** (-exponents / head_dim)
        )
        return angles.cos(), angles.sin()
    # As llama.cpp computes them: the inverse frequencies, the angle, cos and sin in float32.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
    angles = delta * (base ** (-exponents / head_dim))
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_in_dtype(keys: Tensor, delta: int, base: float) -> Tensor:
    """Keys (..., D) rotated by ``delta`` positions under the reference RoPE convention
    (channel i pairs with i + D/2), the products and sums in the keys' own dtype."""
    head_dim = keys.shape[-1]
    cos, sin = _cos_sin(head_dim, base, delta, keys.dtype, keys.device)
    first, second = keys[..., : head_dim // 2], keys[..., head_dim // 2 :]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


# Each token tensor gets storage of its own, exactly its size (see ShiftingListCache.nbytes).
_DENSE = torch.contiguous_format


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class ShiftingListCache:
    """Every token's key and value as its own (B, H_kv, D) tensor in two lists; offers
    ``truncate``, ``reorder``, ``shift`` and a first position of its own (``reset_at``)."""

    keys_stored = "rotated"  # keys are held as given, rotated; a shift re-rotates them

    def __init__(self, spec: kvref.CacheSpec) -> None:
        self.spec = spec
        self._keys: list[Tensor] = []
        self._values: list[Tensor] = []
        self._first = 0

    # --- state --------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return len(self._keys)

    @property
    def first_position(self) -> int:
        return self._first

    @property
    def nbytes(self) -> int:
        # Each token owns its storage (see append), so the sum is what is really held.
        return sum(t.untyped_storage().nbytes() for t in (*self._keys, *self._values))

    def reset(self) -> None:
        self._keys, self._values = [], []
        self._first = 0

    def reset_at(self, first_position: int) -> None:
        if not _is_int(first_position) or first_position < 0:
            raise ValueError(
                f"reset_at: first_position must be an int >= 0, got "
                f"{type(first_position).__name__} {first_position!r}"
            )
        self.reset()
        self._first = first_position

    # --- append -------------------------------------------------------------------------
    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        new = kvref.check_append(self.spec, self.length, key, value, capacity=self.spec.max_length)
        # One clone per token, so that a later truncate or shift that drops tokens frees their
        # bytes (views of one clone of the whole chunk would keep it all alive) and so that
        # nothing of the caller's buffers is kept.
        self._keys.extend(key[:, :, t].clone(memory_format=_DENSE) for t in range(new))
        self._values.extend(value[:, :, t].clone(memory_format=_DENSE) for t in range(new))
        return self._stacked()

    def _stacked(self) -> tuple[Tensor, Tensor]:
        return torch.stack(self._keys, dim=2), torch.stack(self._values, dim=2)

    # --- edits --------------------------------------------------------------------------
    def truncate(self, length: int) -> None:
        kvref.check_truncate(self.length, length)
        del self._keys[length:], self._values[length:]

    def reorder(self, indices: Tensor) -> None:
        kvref.check_reorder(self.spec, indices)
        # index_select makes new tensors, so repeated rows (beam search) are copies, not
        # aliases, and the old token tensors are released.
        self._keys = [t.index_select(0, indices) for t in self._keys]
        self._values = [t.index_select(0, indices) for t in self._values]

    def shift(self, start: int, count: int) -> None:
        kvref.check_shift(self.length, start, count)
        end = start + count
        moved = self._keys[end:]
        if moved:
            # Rotate all moved keys in one call: (B, H_kv, n, D) -> back to per-token tensors.
            rotated = rotate_in_dtype(torch.stack(moved, dim=2), -count, self.spec.rope_base)
            moved = [t.clone(memory_format=_DENSE) for t in rotated.unbind(dim=2)]
        self._keys[start:] = moved
        del self._values[start:end]
