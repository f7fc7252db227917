"""What the kit saw written into each block of a prefix-caching pool, and the hits held to it
(contract, section 9.1).

A prefix hit hands a request rows it never computed, so the oracle for them is not the model
but the request that wrote them: after every feed the engine records, for each block a
request's tables show it writing, the layer, the salt, every token from position 0 to what
the block holds, and the rows given. A lookup's blocks must then be ones last written full,
in that layer, for that salt, with the request's own tokens up to their end; the request's
recorders take those rows as given, so its later appends are checked bit for bit against
them. This sees what logits cannot: a hit on another tenant's block (identical tokens,
identical rows) is a leak all the same.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor

from kvcheck import failures, reach
from kvref import BlockTables, CacheContractError


@dataclass(frozen=True)
class Written:
    """One block as last written: whose rows, for which tokens (0 to what it holds)."""

    request: str
    step: int  # the writer's step that wrote it (or restored it)
    layer: int
    salt: object
    tokens: tuple[int, ...]
    keys: Tensor  # (H_kv, rows written in the block, D), batch row of the writer dropped
    values: Tensor

    def identity(self) -> tuple:
        return self.layer, self.salt, self.tokens


class PrefixBooks:
    """Per block id, the last write the kit saw; and how often each full prefix was written."""

    HIT_IN_CODES = "a prefix hit on blocks in codes"  # an edge of prefix caching (10.1)

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: dict[int, Written] = {}
        self.full_writes: Counter[tuple] = Counter()
        # Full prefixes whose block another request took and wrote over (an eviction).
        self.evicted: set[tuple] = set()

    def wrote(self, request, start: int, end: int, *, count: bool = True) -> None:
        """``request``'s caches were given its positions ``start`` to ``end`` - 1 (or, without
        ``count``, had them restored: no new write of their prefixes, but where another block
        holds the same prefix, a twin: the pool may keep that one published instead, and
        evict it later)."""
        size = self.block_size
        for layer, recorder in enumerate(request.caches):
            keys, values = recorder.given
            for row, table in enumerate(_tables(recorder.cache)):
                if len(table) != -(-end // size):  # blocks dropped outside a window: unmapped
                    continue
                history = tuple(request.history[row, :end].tolist())
                for index in range(start // size, -(-end // size)):
                    held = min(end, (index + 1) * size)
                    rows = slice(index * size, held)
                    written = Written(
                        request.name,
                        request.steps,
                        layer,
                        request.salt,
                        history[:held],
                        keys[row, :, rows].clone(),
                        values[row, :, rows].clone(),
                    )
                    full = held - index * size == size
                    if full and (count or self._twin_of(table[index], written)):
                        self.full_writes[written.identity()] += 1
                    if not count and _extends(self.blocks.get(table[index]), written):
                        continue  # a block a fork shares, held short of what was written there
                    self._overwrite(table[index], written)

    def _twin_of(self, block: int, written: Written) -> bool:
        """Whether a block other than ``block`` holds ``written``'s prefix, as last written."""
        identity = written.identity()
        return any(
            other != block and seen.identity() == identity for other, seen in self.blocks.items()
        )

    def _overwrite(self, block: int, written: Written) -> None:
        old = self.blocks.get(block)
        full = old is not None and old.keys.shape[1] == self.block_size
        if full and old.request != written.request and old.identity() != written.identity():
            self.evicted.add(old.identity())
            reach.note("a cached block evicted and reused for other rows")
        self.blocks[block] = written

    def other_tenant_wrote(self, salt: object, tokens: Tensor) -> bool:
        """Whether a request of another salt wrote a full block of a prefix of ``tokens``."""
        rows = [tuple(row) for row in tokens.tolist()]
        return any(
            seen.salt != salt
            and seen.keys.shape[1] == self.block_size
            and any(row[: len(seen.tokens)] == seen.tokens for row in rows)
            for seen in self.blocks.values()
        )

    def lost_prefix(self, salt: object, tokens: Tensor) -> bool:
        """Whether a full block of a prefix of ``tokens`` (this salt) was evicted and reused,
        and no block holds that prefix now."""
        rows = [tuple(row) for row in tokens.tolist()]
        now = {seen.identity() for seen in self.blocks.values()}
        return any(
            held_salt == salt
            and identity not in now
            and any(row[: len(held)] == held for row in rows)
            for identity in self.evicted
            for _, held_salt, held in (identity,)
        )

    def check_hit(self, request, tokens: Tensor, hit: int, where: str) -> None:
        """The blocks ``request``'s caches hold after a lookup that found ``hit`` tokens of
        ``tokens``: each last written full, in its layer, for its salt, with these tokens;
        the recorders then take the rows written there as given."""
        size = self.block_size
        for layer, recorder in enumerate(request.caches):
            keys, values = [], []
            for row, table in enumerate(_tables(recorder.cache)):
                want = tuple(tokens[row, :hit].tolist())
                if len(table) < hit // size:
                    raise failures.DataLoss(
                        f"{request.name}'s layer {layer}, batch row {row}: its lookup found "
                        f"{hit} tokens, but its block table {table} has {len(table)} blocks "
                        f"of {size}\n  {where}"
                    )
                for index, block in enumerate(table[: hit // size]):
                    end = (index + 1) * size
                    seen = self.blocks.get(block)
                    said = (
                        f"{request.name}'s layer {layer}, batch row {row}: its lookup of "
                        f"{tokens.shape[1]} tokens (salt {request.salt!r}) found {hit}, and "
                        f"block {block} holds its positions {end - size}..{end - 1}"
                    )
                    if seen is None:
                        raise failures.DataLoss(
                            f"{said}, but no request wrote that block\n  {where}"
                        )
                    why = _mismatch(seen, layer, request.salt, want[:end], size)
                    if why:
                        raise failures.DataLoss(
                            f"{said}, but it was last written by {seen.request} (its step "
                            f"#{seen.step}) {why}\n  {where}"
                        )
                keys.append(_rows(self.blocks, table[: hit // size], "keys", recorder, hit))
                values.append(_rows(self.blocks, table[: hit // size], "values", recorder, hit))
            # A published block holds codes where the storage declares them (contract, 10.1):
            # every row of the hit may be, as the publisher's are.
            rows = (torch.stack(keys), torch.stack(values)) if hit else None
            recorder.hold_given(rows, in_codes=hit)
            if hit and any(recorder.storage):
                reach.note(self.HIT_IN_CODES)

    def least_hit(self, engine, request, tokens: Tensor) -> tuple[int, str]:
        """The fewest tokens a lookup of ``tokens`` by ``request`` must find, and who holds
        them: the whole blocks of that prefix (but its last token, which a pool may keep
        back to compute) that another live request holds in every layer, inside the tokens
        it looked up itself (a pool may publish decode blocks later) and its rows now, each
        the only block ever written full with that prefix (no pool can have kept a twin)."""
        size, least, holder = self.block_size, None, ""
        for row in range(tokens.shape[0]):
            want = tuple(tokens[row, :-1].tolist())
            best, by = 0, ""
            for other in engine.live.values():
                if other is request or other.caches is None or other.salt != request.salt:
                    continue
                if any(getattr(recorder.cache, "offloaded", False) for recorder in other.caches):
                    continue
                for other_row in range(other.batch):
                    held = self._held_by(other, other_row, want, size)
                    if held > best:
                        best, by = held, f"{other.name}'s batch row {other_row}"
            if least is None or best < least:
                least, holder = best, f"{by}, for this request's row {row}"
        return least or 0, holder

    def _held_by(self, other, row: int, want: tuple[int, ...], size: int) -> int:
        """How many leading tokens of ``want`` ``other``'s row ``row`` holds in whole blocks
        of every layer, inside what it looked up and holds now, each written once."""
        fewest = None
        mine = min(other.looked_up, other.history.shape[1]) // size
        for layer, recorder in enumerate(other.caches):
            table = _tables(recorder.cache)[row][:mine]
            count = 0
            for index, block in enumerate(table):
                end = (index + 1) * size
                seen = self.blocks.get(block)
                if (
                    end > len(want)
                    or seen is None
                    or _mismatch(seen, layer, other.salt, want[:end], size)
                ):
                    break
                if self.full_writes[seen.identity()] != 1:
                    break
                count = end
            fewest = count if fewest is None else min(fewest, count)
        return fewest or 0


def _tables(cache) -> list[list[int]]:
    """A prefix-caching pool's cache shows its blocks (section 9.1): the hits are judged by
    them."""
    if not isinstance(cache, BlockTables):
        raise CacheContractError(
            f"{type(cache).__name__} is a cache of a prefix-caching pool without block_tables "
            f"(kvref.BlockTables): prefix caching needs them"
        )
    return cache.block_tables


def _extends(seen: Written | None, given: Written) -> bool:
    """Whether ``seen`` is ``given`` and more: the same layer, salt, tokens and rows, then
    rows beyond. A fork or a restore (no new write) that holds a block only partly leaves
    what was written past its end there: a request that rolled back into a block written
    full, then forked, shares that block, which may stay published and be found whole. The
    rows the kit knows are kept, and a hit on the block is held to them bit for bit."""
    if seen is None or (seen.layer, seen.salt) != (given.layer, given.salt):
        return False
    rows = given.keys.shape[1]
    return (
        len(seen.tokens) > len(given.tokens)
        and seen.tokens[: len(given.tokens)] == given.tokens
        and torch.equal(seen.keys[:, :rows], given.keys)
        and torch.equal(seen.values[:, :rows], given.values)
    )


def _mismatch(
    seen: Written, layer: int, salt: object, tokens: tuple[int, ...], block_size: int
) -> str:
    """Why ``seen`` is not a full block of ``tokens`` for ``layer`` and ``salt``, or ""."""
    rows = seen.keys.shape[1]
    # The block's index in a table: its last position's, the block being ``block_size`` rows.
    index, wanted = (len(seen.tokens) - 1) // block_size, (len(tokens) - 1) // block_size
    # Only a block short of full at the index wanted can have been published early: a full
    # block whose tokens are a prefix of these is one from an earlier index.
    early = rows < block_size and index == wanted and len(seen.tokens) < len(tokens)
    if early and seen.tokens == tokens[: len(seen.tokens)]:
        return (
            f"when it held {rows} rows, up to position {len(seen.tokens) - 1}: a block "
            f"published before it was full and written"
        )
    if seen.layer != layer:
        return f"for layer {seen.layer}: a hit must be of its own layer"
    if seen.salt != salt:
        return f"with salt {seen.salt!r}: another tenant's rows (salts isolate tenants)"
    if index != wanted:
        return (
            f"when it held positions {index * block_size}..{len(seen.tokens) - 1} ({rows} "
            f"rows): a block from index {index} of a table, handed back at index {wanted} (a "
            f"key trusted without comparing the tokens before the block, or a hit that "
            f"hands its blocks back out of place)"
        )
    if seen.tokens[: len(tokens)] != tokens or len(seen.tokens) != len(tokens):
        first = next(
            (i for i, (a, b) in enumerate(zip(seen.tokens, tokens, strict=False)) if a != b),
            min(len(seen.tokens), len(tokens)),
        )
        return (
            f"for other tokens (from position {first}: {list(seen.tokens[first : first + 4])} "
            f"where this request has {list(tokens[first : first + 4])}): a key trusted without "
            f"comparing the tokens, a block evicted and reused while still matched, or a "
            f"published block written into (after a rollback, say) while still matched"
        )
    return ""


def _rows(blocks: dict[int, Written], table: list[int], part: str, recorder, hit: int) -> Tensor:
    """One batch row's hit rows, (H_kv, hit, D), as written into the blocks of ``table``."""
    if not table:
        spec = recorder.cache.spec
        width = spec.head_dim if part == "keys" else spec.value_width
        return torch.empty(spec.kv_heads, 0, width, dtype=spec.dtype, device=spec.device)
    return torch.cat([getattr(blocks[block], part) for block in table], dim=1)
