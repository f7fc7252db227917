"""Style: an engine (contract, section 13) that keeps each sequence apart: per sequence, the
positions of its tokens in order and per layer one (tokens, kv heads, D) tensor of keys and
one of values; a context shift's re-rotation is deferred, per token, to the sequence's next
decode.

``decode`` runs each step's tokens through the model over its own sequence's rows (a token
sees its sequence's tokens at positions up to its own). ``remove`` drops the span's tokens
from the lists, ``copy`` clones the source's lists into the target, ``clear`` forgets every
sequence. ``shift`` moves the positions at once but only notes, per token, the rotation its
keys still need (``_Sequence.lag``): a sequence's keys are rotated when that sequence is
next decoded, so a shift of a sequence that is not decoded again costs nothing, and a
removal then shift (a context shift) of a long sequence rotates its keys once.

The one bug (``LagEngineOverwritesPendingRotation``): ``shift`` sets a token's lag to the
delta instead of adding the delta to it.

- First event: a ``shift`` of a sequence (a suffix moved on, or a context shift), leaving
  "rotations pending on its tokens" until that sequence's next decode.
- Second event: another ``shift`` of some of the same tokens before that decode (other
  sequences may be decoded between: their decodes do not rotate this one's keys).
- A correct engine rotates each token by the sum of its shifts; this one by the last alone,
  so the earlier shift's rotation is lost and the keys attend from positions they no longer
  hold. A shift followed by a decode of its sequence, then another shift, is right.

Stands for llama.cpp's deferred K-shift, whose pending deltas must accumulate
(``llama_kv_cells::pos_add`` keeps ``shift[i] += d`` until the next update; llama.cpp #3835
made the shift "accumulate deltas", and #4097 is about repeated shifts of the same cells,
BUGS.md section 3.2): written as an assignment, two ``llama_memory_seq_add`` calls before the
sequence's next decode keep only the second. The twin (``LagEngineAddsPendingRotation``)
adds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from kvref.engine import EngineSpec, Step
from kvref.model import ReferenceTransformer
from kvref.rope import apply_rope, rerotate


class _Sequence:
    """One sequence's tokens: positions, per-layer keys and values, and pending rotations."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, like: dict) -> None:
        self.positions: list[int] = []
        self.lag: list[int] = []  # per token: the rotation its keys still need
        self.keys = [torch.zeros((0, kv_heads, head_dim), **like) for _ in range(layers)]
        self.values = [torch.zeros((0, kv_heads, head_dim), **like) for _ in range(layers)]

    def clone(self) -> _Sequence:
        twin = object.__new__(_Sequence)
        twin.positions, twin.lag = list(self.positions), list(self.lag)
        twin.keys = [k.clone() for k in self.keys]
        twin.values = [v.clone() for v in self.values]
        return twin

    def keep(self, keep: list[bool]) -> None:
        index = torch.tensor([i for i, kept in enumerate(keep) if kept], dtype=torch.long)
        self.positions = [p for p, kept in zip(self.positions, keep, strict=True) if kept]
        self.lag = [d for d, kept in zip(self.lag, keep, strict=True) if kept]
        index = index.to(self.keys[0].device)
        self.keys = [k[index] for k in self.keys]
        self.values = [v[index] for v in self.values]


class LagEngineOverwritesPendingRotation:
    accumulate = False  # the bug: a second pending shift replaces the first

    def __init__(self, model: ReferenceTransformer, spec: EngineSpec) -> None:
        c = model.config
        if c.attention != "gqa" or c.window is not None or c.kv_sources is not None:
            raise NotImplementedError("this engine runs plain Llama-style models only")
        self.model, self.spec = model, spec
        self._like = {"dtype": model.dtype, "device": model.device}
        self._sequences: dict[int, _Sequence] = {}

    def _sequence(self, sequence: int) -> _Sequence:
        if sequence not in self._sequences:
            c = self.model.config
            self._sequences[sequence] = _Sequence(
                c.num_layers, c.num_kv_heads, c.head_dim, self._like
            )
        return self._sequences[sequence]

    def _rotate_pending(self, seq: _Sequence) -> None:
        """Apply each token's pending rotation to its keys, every layer, then forget it."""
        base = self.model.config.rope_base
        for delta in set(seq.lag) - {0}:
            index = torch.tensor(
                [i for i, d in enumerate(seq.lag) if d == delta], device=self._like["device"]
            )
            for keys in seq.keys:
                # (tokens, heads, D) as (heads, tokens, D): rerotate turns the tokens axis.
                keys[index] = rerotate(keys[index].transpose(0, 1), delta, base).transpose(0, 1)
        seq.lag = [0] * len(seq.lag)

    @torch.no_grad()
    def decode(self, steps: Sequence[Step]) -> list[Tensor]:
        return [self._run(step) for step in steps]

    def _run(self, step: Step) -> Tensor:
        seq = self._sequence(step.sequence)
        self._rotate_pending(seq)
        model, c = self.model, self.model.config
        device = self._like["device"]
        tokens = torch.tensor(step.tokens, dtype=torch.long, device=device)
        at = torch.tensor(step.positions, dtype=torch.long, device=device)
        x = model.embedding(tokens)  # (T, d_model)
        new = len(step.tokens)
        for layer, block in enumerate(model.blocks):
            attention, normed = block.attention, block.attention_norm(x)
            q = attention.query(normed).view(new, c.num_heads, c.head_dim).transpose(0, 1)
            k = attention.key(normed).view(new, c.num_kv_heads, c.head_dim).transpose(0, 1)
            v = attention.value(normed).view(new, c.num_kv_heads, c.head_dim)
            q = apply_rope(q[None], at, c.rope_base)[0]  # (H, T, D)
            k = apply_rope(k[None], at, c.rope_base)[0].transpose(0, 1)  # (T, H_kv, D)
            seq.keys[layer] = torch.cat((seq.keys[layer], k))
            seq.values[layer] = torch.cat((seq.values[layer], v))
            held = torch.tensor(seq.positions + list(step.positions), device=device)
            group = c.num_heads // c.num_kv_heads
            keys = seq.keys[layer].transpose(0, 1).repeat_interleave(group, dim=0)
            values = seq.values[layer].transpose(0, 1).repeat_interleave(group, dim=0)
            scores = (q @ keys.transpose(-2, -1)) / math.sqrt(c.head_dim)
            seen = held[None, :] <= at[:, None]
            weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
            mixed = (weights @ values).transpose(0, 1).reshape(new, c.num_heads * c.head_dim)
            x = x + attention.out(mixed)
            x = x + block.feed_forward(x)
        seq.positions.extend(step.positions)
        seq.lag.extend([0] * new)
        return model.final_norm(x) @ model.embedding.weight.T

    def clear(self) -> None:
        self._sequences = {}

    def remove(self, sequence: int, start: int, end: int | None) -> None:
        seq = self._sequences.get(sequence)
        if seq is None:
            return
        seq.keep([not (p >= start and (end is None or p < end)) for p in seq.positions])

    def copy(self, source: int, target: int) -> None:
        if source in self._sequences:
            self._sequences[target] = self._sequences[source].clone()
        else:
            self._sequences.pop(target, None)

    def shift(self, sequence: int, start: int, end: int | None, delta: int) -> None:
        seq = self._sequences.get(sequence)
        if seq is None:
            return
        for i, p in enumerate(seq.positions):
            if p >= start and (end is None or p < end):
                seq.positions[i] = p + delta
                if self.accumulate:
                    seq.lag[i] += delta
                else:
                    seq.lag[i] = delta  # Bug: a rotation still pending is lost


class LagEngineAddsPendingRotation(LagEngineOverwritesPendingRotation):
    """The twin: a shift adds its delta to the rotation pending."""

    accumulate = True
