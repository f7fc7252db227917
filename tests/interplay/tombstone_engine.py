"""Style: an engine (contract, section 13) over one arena of slots per layer, each sequence a
map from position to slot, with removals recorded as tombstones and reclaimed lazily.

Per layer the keys and values of every token live in an arena, (slots, kv heads, D), that
doubles when full; a free list hands slots out. Each sequence is a dict ``position -> slot``
and a set of tombstones: ``remove`` only marks the span's positions dead, and the slots are
freed and the map entries deleted when the sequence is next compacted (``_compact``), which
``decode`` and ``shift`` do before they read the map: a removal costs nothing until the
sequence runs again, and a sequence removed and never run again is reclaimed once. ``copy``
gives the target fresh slots holding copies of the source's rows (no sharing, so nothing to
copy on write later); ``shift`` re-keys the map and re-rotates the moved keys at once.

The one bug (``TombstoneEngineCopiesDeadEntries``): ``copy`` duplicates the source's map
without compacting it first, so positions the source removed but has not yet reclaimed come
back to life in the target (without their tombstones).

- First event: ``remove`` of a span of the source (a rejected draft, a context edit),
  leaving "tombstones not yet reclaimed" until the source's next decode or shift.
- Second event: ``copy`` of that source (a fork of the edited sequence, as a server forks
  a slot for a parallel sample) before the source runs again.
- A correct engine copies what the source holds; this one also copies the removed tokens,
  which the target's later tokens then attend to (and which are in the way of its own
  feeds at the same positions). A copy of a sequence that ran since its last removal, and a
  removal of a copy, are right.

Stands for engines with deferred reclamation (a free that waits for the scheduler's next
step) whose copy path reads the raw structure instead of the compacted view every other
path reads: the ``seq_rm``/``seq_cp`` bookkeeping class of BUGS.md section 3.2 (llama.cpp
#3840, removal by cell index; #12160, ``seq_rm`` with a shift removing valid tokens). The
twin (``TombstoneEngineCompactsBeforeCopy``) compacts the source first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from kvref.engine import EngineSpec, Step
from kvref.model import ReferenceTransformer
from kvref.rope import apply_rope, rerotate


class TombstoneEngineCopiesDeadEntries:
    compact_source = False  # the bug: copy reads the source's map with its tombstones in it

    def __init__(self, model: ReferenceTransformer, spec: EngineSpec) -> None:
        c = model.config
        if c.attention != "gqa" or c.window is not None or c.kv_sources is not None:
            raise NotImplementedError("this engine runs plain Llama-style models only")
        self.model, self.spec = model, spec
        self._like = {"dtype": model.dtype, "device": model.device}
        self._k: list[Tensor] = []
        self._v: list[Tensor] = []
        self._free: list[int] = []
        self._grow(spec.max_tokens)
        self._maps: dict[int, dict[int, int]] = {}  # sequence -> {position: slot}
        self._dead: dict[int, set[int]] = {}  # sequence -> positions removed, not reclaimed

    # --- the arena -------------------------------------------------------------------

    def _grow(self, more: int) -> None:
        c, size = self.model.config, (self._k[0].shape[0] if self._k else 0)
        shape = (size + more, c.num_kv_heads, c.head_dim)
        for arena in (self._k, self._v):
            for layer in range(c.num_layers):
                wider = torch.zeros(shape, **self._like)
                if arena and len(arena) > layer:
                    wider[:size] = arena[layer]
                    arena[layer] = wider
                else:
                    arena.append(wider)
        self._free.extend(range(size + more - 1, size - 1, -1))  # lowest slot on top

    def _take(self, count: int) -> list[int]:
        if count > len(self._free):
            self._grow(max(count, self._k[0].shape[0]))  # doubles, at least
        return [self._free.pop() for _ in range(count)]

    def _compact(self, sequence: int) -> None:
        """Reclaim the sequence's tombstones: free their slots, drop their entries."""
        slots, dead = self._maps.get(sequence, {}), self._dead.get(sequence, set())
        for position in dead:
            self._free.append(slots.pop(position))
        dead.clear()

    # --- the protocol ----------------------------------------------------------------

    @torch.no_grad()
    def decode(self, steps: Sequence[Step]) -> list[Tensor]:
        return [self._run(step) for step in steps]

    def _run(self, step: Step) -> Tensor:
        self._compact(step.sequence)
        slots = self._maps.setdefault(step.sequence, {})
        self._dead.setdefault(step.sequence, set())
        model, c = self.model, self.model.config
        device = self._like["device"]
        new = len(step.tokens)
        placed = self._take(new)
        for position, slot in zip(step.positions, placed, strict=True):
            slots[position] = slot
        held = sorted(slots)  # every position the sequence holds now, its new ones included
        index = torch.tensor([slots[p] for p in held], dtype=torch.long, device=device)
        key_at = torch.tensor(held, dtype=torch.long, device=device)
        at = torch.tensor(step.positions, dtype=torch.long, device=device)
        where = torch.tensor(placed, dtype=torch.long, device=device)
        x = model.embedding(torch.tensor(step.tokens, dtype=torch.long, device=device))
        group = c.num_heads // c.num_kv_heads
        for layer, block in enumerate(model.blocks):
            attention, normed = block.attention, block.attention_norm(x)
            q = attention.query(normed).view(new, c.num_heads, c.head_dim).transpose(0, 1)
            k = attention.key(normed).view(new, c.num_kv_heads, c.head_dim).transpose(0, 1)
            v = attention.value(normed).view(new, c.num_kv_heads, c.head_dim)
            q = apply_rope(q[None], at, c.rope_base)[0]
            self._k[layer][where] = apply_rope(k[None], at, c.rope_base)[0].transpose(0, 1)
            self._v[layer][where] = v
            keys = self._k[layer][index].transpose(0, 1).repeat_interleave(group, dim=0)
            values = self._v[layer][index].transpose(0, 1).repeat_interleave(group, dim=0)
            scores = (q @ keys.transpose(-2, -1)) / math.sqrt(c.head_dim)
            seen = key_at[None, :] <= at[:, None]
            weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
            mixed = (weights @ values).transpose(0, 1).reshape(new, c.num_heads * c.head_dim)
            x = x + attention.out(mixed)
            x = x + block.feed_forward(x)
        return model.final_norm(x) @ model.embedding.weight.T

    def clear(self) -> None:
        for sequence in list(self._maps):
            self._dead[sequence] = set(self._maps[sequence])
            self._compact(sequence)
        self._maps, self._dead = {}, {}

    def remove(self, sequence: int, start: int, end: int | None) -> None:
        slots, dead = self._maps.get(sequence, {}), self._dead.setdefault(sequence, set())
        dead.update(p for p in slots if p >= start and (end is None or p < end))

    def copy(self, source: int, target: int) -> None:
        self._compact(target)  # the target is empty: whatever it left goes back first
        for slot in self._maps.pop(target, {}).values():
            self._free.append(slot)
        if self.compact_source:
            self._compact(source)
        # Bug (compact_source False): the source's unreclaimed removals are copied live.
        theirs = self._maps.get(source, {})
        mine = dict(zip(theirs, self._take(len(theirs)), strict=True))
        if mine:
            src = torch.tensor(list(theirs.values()), device=self._like["device"])
            dst = torch.tensor(list(mine.values()), device=self._like["device"])
            for arena in (self._k, self._v):
                for layer in arena:
                    layer[dst] = layer[src]
        self._maps[target], self._dead[target] = mine, set()

    def shift(self, sequence: int, start: int, end: int | None, delta: int) -> None:
        self._compact(sequence)
        slots = self._maps.get(sequence, {})
        moving = {p: s for p, s in slots.items() if p >= start and (end is None or p < end)}
        if not moving:
            return
        staying = {p: s for p, s in slots.items() if p not in moving}
        self._maps[sequence] = staying | {p + delta: s for p, s in moving.items()}
        index = torch.tensor(list(moving.values()), device=self._like["device"])
        base = self.model.config.rope_base
        for keys in self._k:
            keys[index] = rerotate(keys[index].transpose(0, 1), delta, base).transpose(0, 1)


class TombstoneEngineCompactsBeforeCopy(TombstoneEngineCopiesDeadEntries):
    """The twin: ``copy`` reclaims the source's tombstones before it reads its map."""

    compact_source = True
