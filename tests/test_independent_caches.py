"""No false alarms: correct caches written independently, each with its own storage,
validation and wording (``tests/independent``), hold every property of the kit. A failure
here is a bug of the suite, not of the cache."""

import pytest
import torch

from kvcheck import (
    AttendTests,
    CacheTests,
    CoreTests,
    ForkTests,
    MemoryTests,
    PoolTests,
    RowsTests,
    ServingTests,
    SharedLayersTests,
)
from kvcheck import badinput as kvbad
from kvcheck.kit import KitTests, property_test
from kvcheck.properties.shared import SHARED_ROWS, SHARED_TREE
from kvcheck.properties.shift import ShiftTests
from kvcheck.properties.sinks import SinksTests
from kvcheck.properties.tree import TreeTests
from tests import depth
from tests.independent.aside_tree_cache import AsideTreeCache, AsideTreeRowsCache
from tests.independent.coded_radix_pool import CodedRadixPool
from tests.independent.deque_window_cache import DequeWindowCache
from tests.independent.fifo_paged_pool import FifoPagedPool
from tests.independent.fp8_segment_cache import Fp8SegmentCache
from tests.independent.group_int4_cache import GroupInt4Cache
from tests.independent.half_kernel_cache import HalfKernelCache
from tests.independent.head_keyed_cache import HeadKeyedCache
from tests.independent.kivi_group_cache import KiviGroupCache
from tests.independent.left_padded_batch_cache import LeftPaddedBatchCache
from tests.independent.left_padded_shifting_cache import LeftPaddedShiftingCache
from tests.independent.list_cache import ListCache
from tests.independent.packed_varlen_cache import PackedVarlenCache
from tests.independent.paged_cache import PagedCache
from tests.independent.paged_latent_cache import PagedLatentCache
from tests.independent.pooled_ring_cache import RingCache
from tests.independent.radix_prefix_pool import RadixPrefixPool
from tests.independent.residual_rows_cache import ResidualRowsCache
from tests.independent.sdpa_cache import SdpaCache
from tests.independent.shifting_list_cache import ShiftingListCache
from tests.independent.sink_list_cache import SinkListCache
from tests.independent.slot_cache import SlotCache
from tests.independent.stacked_cache import StackedCache
from tests.independent.view_cache import ViewCache

# Built on the kit's device (--kv-device): skipped where this machine lacks it.
pytestmark = pytest.mark.kv_device


# The default run holds each of the caches below without a soak mark to the areas it was
# written to exercise (``depth.written_for``: a fused-kernel domain, a paged pool, attend by
# torch's fused kernel, rows of their own, 4-bit codes, latent pages, context shift, sinks,
# prefix caching); --soak holds every one to every property: each runs some 80 tests,
# whatever its examples.
#
# One drawn example a property in the default run, a quarter of the profile's under --soak:
# these caches guard against false alarms and have held over 20 dev seeds and searches of 100
# to 150 extra examples; the thorough profile still gives them 500 per property.
EXAMPLES_SCALE = depth.pick(0.05, soak=0.25)


class Independent(CacheTests):
    examples_scale = EXAMPLES_SCALE


@pytest.mark.soak
class TestListCache(Independent):
    factory = ListCache


@pytest.mark.soak
class TestStackedCache(Independent):
    factory = StackedCache


@pytest.mark.soak
class TestPagedCache(Independent):
    factory = PagedCache


@pytest.mark.soak
class TestSlotCache(Independent):
    factory = SlotCache


@pytest.mark.soak
class TestViewCache(Independent):
    factory = ViewCache


@pytest.mark.soak
class TestRingCache(Independent):
    factory = RingCache


@pytest.mark.soak
class TestHeadKeyedCache(Independent):
    """A dict keyed by global kv head id (the shard's, in a tensor-parallel run), each head's
    rows in token-major chunks of 5; truncate, reorder, export_rows and import_rows."""

    factory = HeadKeyedCache


@pytest.mark.soak
class TestDequeWindowCache(Independent):
    """Windows, truncate and reorder, written without reading the built-in window cache."""

    factory = DequeWindowCache


class TestFifoPagedPool(*depth.written_for(PoolTests, ForkTests, AttendTests)):
    """A paged pool (fork, attend, truncate, block tables) in another style than the
    built-in: a FIFO free list, a tensor pair per block, copy-on-write at fork time."""

    factory = FifoPagedPool()
    cache_name = "FifoPagedPool"
    examples_scale = EXAMPLES_SCALE


class TestSdpaCache(*depth.written_for(CoreTests, AttendTests)):
    """attend by torch's fused scaled_dot_product_attention in the storage dtype (no float32
    upcast of its own), with an explicit mask; a list of the pieces each call brought, forked
    by copying the list; truncate and reorder."""

    factory = SdpaCache
    examples_scale = EXAMPLES_SCALE


class TestShiftingListCacheShift(ShiftTests):
    """Context shift over lists of tokens, the moved keys re-rotated in the storage dtype
    with float32 angles as llama.cpp forms them (contract, section 8.4), written from the
    contract alone: the default run holds it to the property it was written for, --soak to
    every property."""

    factory = ShiftingListCache
    examples_scale = depth.pick(0.2, soak=1.0)


@pytest.mark.soak
class TestShiftingListCache(Independent):
    factory = ShiftingListCache


class TestSinkListCacheSinks(SinksTests):
    """Attention sinks in a tensor of sinks and a deque of recent chunks, joined per append
    (contract, section 8.5), written from the contract alone: the default run holds it to the
    property it was written for, --soak to every property."""

    factory = SinkListCache
    examples_scale = depth.pick(0.2, soak=1.0)


@pytest.mark.soak
class TestSinkListCache(Independent):
    factory = SinkListCache


class TestLeftPaddedBatchCache(*depth.written_for(CoreTests, RowsTests)):
    """Rows of their own in one dense, left-padded tensor pair, as batch generation keeps
    them (contract, section 8.1), written from the contract alone."""

    factory = LeftPaddedBatchCache
    examples_scale = EXAMPLES_SCALE


class TestPackedVarlenCache(*depth.written_for(CoreTests, RowsTests)):
    """Rows of their own packed back to back in one (total_tokens, H_kv, D) tensor pair with
    cumulative offsets, as flash-attn's varlen kernels take them (cu_seqlens), fed
    left-padded and returned left-aligned (contract, section 8.1), written from the contract
    alone."""

    factory = PackedVarlenCache
    examples_scale = EXAMPLES_SCALE


class TestLeftPaddedShiftingCache(*depth.written_for(ShiftTests)):
    """The left-padded batch with a context shift per row (contract, section 8.4), each row's
    moved keys re-rotated in the storage dtype with float32 angles, written from the contract
    alone: the default run holds it to context shift (per row and, on rows of one length, of
    the batch; its rows are the left-padded cache's, held to theirs above), --soak to every
    property."""

    factory = LeftPaddedShiftingCache
    examples_scale = EXAMPLES_SCALE


class TestGroupInt4Cache(*depth.written_for(CoreTests, MemoryTests)):
    """Symmetric 4-bit codes packed two to a byte, a scale per group of 32 channels, the last
    8 rows as given, in lists of per-token chunks (contract, section 10.1): held to the bound
    it declares, every row check and the logits budget without a false alarm."""

    factory = GroupInt4Cache
    examples_scale = EXAMPLES_SCALE


class TestFp8SegmentCache(*depth.written_for(CoreTests, MemoryTests)):
    """float8 codes (e4m3fn on even head_dims, e5m2 on odd), a scale per token, per block of
    8 channels or one fixed per tensor by the spec, one segment per append (contract,
    section 10.1's float codes): held to the relative bound it declares, saturation included."""

    factory = Fp8SegmentCache
    examples_scale = EXAMPLES_SCALE


class TestKiviGroupCache(*depth.written_for(CoreTests, MemoryTests)):
    """KIVI's layout: 2-bit keys per channel over groups of 4 or 8 tokens, 4-bit values per
    token with a floor on the step (HQQ's), a full-precision residual of the last len % group
    tokens, in a dict of flushed groups (contract, section 10.1's groups along tokens)."""

    factory = KiviGroupCache
    examples_scale = EXAMPLES_SCALE


class TestPagedLatentCache(*depth.written_for(CoreTests, SharedLayersTests, AttendTests)):
    """A latent (MLA) cache in pages of 8 tokens allocated on demand, rope keys and latents
    in lists of their own, gathered by torch.cat, attending page by page with an online
    softmax (contract, section 10.2): held to every property on MLA models and latent
    specs, attend_latent among them."""

    factory = PagedLatentCache
    examples_scale = EXAMPLES_SCALE


class TestHalfKernelCache(*depth.written_for(CoreTests)):
    """Built for float16 and bfloat16 and head widths 64 and 128 only, as a fused kernel is,
    refusing every other spec and declaring that domain: the kit draws inside it."""

    factory = HalfKernelCache
    # Every draw in half precision: the budget's hardest case.
    examples_scale = depth.pick(0.15, soak=1.0)


class TestRadixPrefixPoolServing(ServingTests):
    """Prefix caching in a radix tree of block-sized token edges, evicting unlocked leaves
    least recently used first, keyed by the tokens themselves (no hash), with offload to host
    memory (contract, sections 9.1 and 9.3), written from the contract alone: the default run
    holds it to the properties it was written for, --soak to every property."""

    factory = RadixPrefixPool()
    cache_name = "RadixPrefixPool"
    examples_scale = depth.pick(0.25, soak=1.0)


@pytest.mark.soak
class TestRadixPrefixPool(Independent):
    factory = RadixPrefixPool()
    cache_name = "RadixPrefixPool"


@pytest.mark.soak  # a second per-row check beside TestLeftPaddedBatchCache's: a second
class TestResidualRowsCache(Independent):
    """Rows of their own, each row's tokens coded in place once they leave its own residual
    of the last 3 (contract, section 10.1)."""

    factory = ResidualRowsCache


@pytest.mark.soak  # its prefix sessions cost seconds: the built-in coded pool runs by default
class TestCodedRadixPool(Independent):
    """The radix pool with blocks in symmetric int8 codes, a scale per 4 channels of each
    token (contract, section 10.1), coding on write and decoding on read: prefix hits on the
    publisher's codes, offload and restore of codes."""

    factory = CodedRadixPool()
    cache_name = "CodedRadixPool"


BY_NAME = {case.name: case for case in kvbad.BAD_APPENDS}
KEY = (1, 1, 1, 2)  # a good key's shape in the examples below: batch 1, 1 head, 1 token, D 2


@pytest.mark.parametrize(
    ("case", "message", "bad_shapes"),
    [
        ("key of rank 3", "key and value must be 4-D, got 3-D and 4-D", ((1, 1, 1), KEY)),
        (
            "value with one token more than key",
            "key shape (1, 1, 1, 2) != value shape (1, 1, 2, 2)",
            (KEY, (1, 1, 2, 2)),
        ),
        ("wrong batch", "(B, H, D): expected (1, 1, 2), got (2, 1, 2)", ((2, 1, 1, 2),) * 2),
        ("wrong head_dim", "head size 3, want 2", ((1, 1, 1, 3),) * 2),
        ("wrong dtype", "expected torch.float64 on cpu, got torch.float32", (KEY, KEY)),
        ("key not a tensor", "expected a Tensor for key, got list", (KEY, KEY)),
        ("zero new tokens", "need at least one token", ((1, 1, 0, 2),) * 2),
        ("wrong batch", "B=2!=1", ((2, 1, 1, 2),) * 2),
        ("wrong kv_heads", "H=2!=1", ((1, 2, 1, 2),) * 2),
        ("wrong head_dim", "D=3!=2", ((1, 1, 1, 3),) * 2),
        ("key of rank 3", "expected 4 axes, got 3 and 4", ((1, 1, 1), KEY)),
        ("value with one token more than key", "k/v T: 1 vs 2", (KEY, (1, 1, 2, 2))),
        ("wrong batch", "got B,H,D = 2,1,2; built for 1,1,2", ((2, 1, 1, 2),) * 2),
    ],
)
def test_a_message_in_other_words_names_the_problem(case, message, bad_shapes):
    bad = tuple(torch.zeros(shape) for shape in bad_shapes)
    assert BY_NAME[case].named_in(message, bad), f"{case}: {message!r} names the problem"


def test_a_message_naming_another_axis_is_not_taken_for_this_one():
    wrong_heads = (torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2))
    assert not BY_NAME["wrong kv_heads"].named_in("head_dim 3 != 2", wrong_heads)


@pytest.mark.parametrize("message", ["", "invalid input", "error", "bad call", "invalid shape"])
@pytest.mark.parametrize("case", kvbad.BAD_APPENDS, ids=str)
def test_an_empty_or_irrelevant_message_names_nothing(case, message):
    bad = (torch.zeros(KEY), torch.zeros(KEY))
    assert not case.named_in(message, bad), f"{case}: {message!r} names nothing"


class TestAsideTreeCacheTree(TreeTests):
    """Tree drafts whose nodes wait beside the rows, every row one length: the default run
    holds it to the property it was written for, --soak to every property."""

    factory = AsideTreeCache
    examples_scale = depth.pick(0.15, soak=1.0)


class TestAsideTreeRowsCacheTree(TreeTests):
    """The same with rows of their own, each committing a path of its own length."""

    factory = AsideTreeRowsCache
    examples_scale = depth.pick(0.15, soak=1.0)


class SharedReaders(KitTests):
    """Layers that share a cache through rows of their own and under a tree (contract,
    section 10.3), in the default run too: a reader reads these caches' returned rows after
    the layers between it and its source wrote theirs."""

    examples_scale = EXAMPLES_SCALE
    test_shared_layers_through_rows_of_their_own = property_test(SHARED_ROWS)
    test_shared_layers_under_a_tree = property_test(SHARED_TREE)


class TestLeftPaddedBatchCacheSharedReaders(SharedReaders):
    factory = LeftPaddedBatchCache


class TestAsideTreeRowsCacheSharedReaders(SharedReaders):
    factory = AsideTreeRowsCache


@pytest.mark.soak
class TestAsideTreeCache(Independent):
    factory = AsideTreeCache


@pytest.mark.soak
class TestAsideTreeRowsCache(Independent):
    factory = AsideTreeRowsCache
