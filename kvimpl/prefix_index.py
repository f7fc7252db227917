"""The published blocks of a prefix-caching pool (contract, section 9.1).

A block is published once it is full and written: from then on a request whose tokens start
with the same prefix finds it instead of computing it again. ``PrefixIndex`` keeps which
block holds which prefix, and which published blocks no live cache references (idle), least
recently used first, for the pool to evict when it runs short.

A block is looked up by a chained key: the hash of its tokens, its salt and the key of the
block before it (``block_hash``, which a test may replace with one that collides). A key is
never trusted alone: a hit must also have the same ``Prefix``, every token from position 0
to the block's end, the layer, the salt and the first position. Two requests that computed
the same prefix at once both write a block; the first published is kept, the second stays
unpublished and is freed like any other.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

BlockHash = Callable[[Hashable, tuple[int, ...], Hashable], Hashable]


def default_hash(parent: Hashable, tokens: tuple[int, ...], salt: Hashable) -> Hashable:
    """Python's hash of the three: collisions are possible, and harmless (``Prefix``)."""
    return hash((parent, tokens, salt))


@dataclass(frozen=True)
class Prefix:
    """What a published block holds: the rows of ``tokens`` (from position 0 to the block's
    end) in one layer, for one salt, from one first position, in blocks of one shape."""

    shape: Hashable  # the pool's storage group: kv heads, head_dim, dtype, device
    layer: int
    salt: Hashable
    first: int
    tokens: tuple[int, ...]


class PrefixIndex:
    """Published blocks by chained key, confirmed by ``Prefix``; idle ones in LRU order."""

    def __init__(self, block_hash: BlockHash | None = None) -> None:
        self.block_hash = block_hash or default_hash
        self._by_key: dict[Hashable, list[int]] = {}  # a key's blocks: collisions share one
        self._of_block: dict[int, tuple[Hashable, Prefix]] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently used first

    @property
    def cached(self) -> int:
        return len(self._of_block)

    @property
    def idle(self) -> int:
        return len(self._idle)

    def chained(self, parent: Hashable, tokens: tuple[int, ...], salt: Hashable) -> Hashable:
        """The key of a block of ``tokens`` after the block keyed ``parent`` (None first)."""
        return self.block_hash(parent, tokens, salt)

    def find(self, key: Hashable, prefix: Prefix) -> int | None:
        """The published block of ``key`` that holds ``prefix``, or None."""
        for block in self._by_key.get((prefix.shape, prefix.layer, prefix.first, key), ()):
            if self._of_block[block][1] == prefix:
                return block
        return None

    def is_published(self, block: int) -> bool:
        return block in self._of_block

    def publish(self, block: int, key: Hashable, prefix: Prefix) -> None:
        """Publish ``block`` as holding ``prefix``, unless another block already does."""
        if block in self._of_block or self.find(key, prefix) is not None:
            return
        full_key = (prefix.shape, prefix.layer, prefix.first, key)
        self._by_key.setdefault(full_key, []).append(block)
        self._of_block[block] = (full_key, prefix)

    def withdraw(self, block: int) -> None:
        """Unpublish ``block`` (in use, about to be written into: a published block never
        changes); nothing when it is not published."""
        if block in self._of_block:
            full_key, _ = self._of_block.pop(block)
            self._by_key[full_key].remove(block)
            if not self._by_key[full_key]:
                del self._by_key[full_key]

    def rest(self, block: int) -> None:
        """``block`` is published and no live cache references it any more: evictable."""
        self._idle[block] = None

    def wake(self, block: int) -> None:
        """An idle ``block`` is referenced again (a hit)."""
        del self._idle[block]

    def evict_oldest(self) -> int:
        """Unpublish the least recently used idle block and return it, to be freed."""
        block, _ = self._idle.popitem(last=False)
        full_key, _ = self._of_block.pop(block)
        same_key = self._by_key[full_key]
        same_key.remove(block)
        if not same_key:
            del self._by_key[full_key]
        return block
