"""The oracle is tested too: if the reference model were wrong, every cache would be held to
the wrong answer. These properties hold for any correct decoder-only transformer with RoPE."""

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvimpl
from examples import doubling_cache as examples_doubling
from kvcheck import asserts as kvassert
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvimpl.latent import LatentCache
from kvref import CacheContractError, ModelConfig, ReferenceTransformer
from kvref import attention as kvref_attention
from kvref.model import ZERO_TOKEN
from kvref.rows import row_slots, rows_laid_out
from kvref.varlen import varlen_attention
from tests import depth

# Built on the kit's device (--kv-device): skipped where this machine lacks it.
pytestmark = pytest.mark.kv_device


@given(data=st.data())
def test_changing_a_later_token_never_changes_earlier_logits(data):
    config = data.draw(kvst.model_configs(), label="config")
    batch = data.draw(st.integers(1, 3), label="batch")
    length = data.draw(st.integers(2, 40), label="length")
    changed_from = data.draw(st.integers(1, length - 1), label="changed_from")
    model = kvtensors.build_model(config, torch.float64)
    tokens = kvtensors.random_tokens(
        config, batch, length, seed=data.draw(st.integers(0, 99), label="seed")
    )
    edited = tokens.clone()
    edited[:, changed_from:] = (edited[:, changed_from:] + 1) % config.vocab_size
    kvassert.assert_close_at(
        model(edited)[:, :changed_from],
        model(tokens)[:, :changed_from],
        what="logits before the edited tokens",
        where=f"tokens edited from position {changed_from} on",
        position_axis=1,
    )


@given(data=st.data())
def test_a_global_position_offset_does_not_change_logits(data):
    config = data.draw(kvst.model_configs(), label="config")
    dtype = data.draw(st.sampled_from(kvst.DTYPES), label="dtype")
    length = data.draw(st.integers(1, 30), label="length")
    offset = data.draw(st.integers(1, 5000), label="offset")
    model = kvtensors.build_model(config, dtype)
    tokens = kvtensors.random_tokens(config, 2, length, seed=length)
    kvassert.assert_close_at(
        model(tokens, start_position=offset),
        model(tokens),
        what="logits at shifted and unshifted positions",
        where=f"all positions shifted by {offset}",
        position_axis=1,
    )


def naive_logits(model: ReferenceTransformer, tokens: torch.Tensor) -> torch.Tensor:
    """The same transformer written the slow way: one query, one head, one key at a time,
    with RoPE as multiplication by a complex phase; in MLA, each head's key and value
    up-projected from the latent; a layer that reads another's (``kv_sources``) attending
    over what that layer caches (in MLA its latent and rope key, up-projected with the
    reader's own weights: contract 10.3). Shares nothing with kvref but weights."""
    c = model.config
    weights = model.state_dict()
    group = c.num_heads // c.num_kv_heads
    mla = c.attention == "mla"

    def rms_norm(x, weight):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * weight

    def rotate(vector, position):
        half = len(vector) // 2
        theta = torch.tensor(
            [c.rope_base ** (-2 * i / len(vector)) for i in range(half)], dtype=torch.float64
        )
        phase = torch.polar(torch.ones(half, dtype=torch.float64), position * theta)
        turned = torch.complex(vector[:half], vector[half:]) * phase
        return torch.cat((turned.real, turned.imag))

    x = weights["embedding.weight"][tokens]
    batch, length, _ = x.shape
    cached = {}  # by layer with a cache of its own: what it caches (k, v), for its readers
    for layer in range(c.num_layers):
        window = c.layer_window(layer) or length  # the whole prefix when global
        w = {name.removeprefix(f"blocks.{layer}."): t for name, t in weights.items()}
        h = rms_norm(x, w["attention_norm.weight"])
        q = (h @ w["attention.query.weight"].T).view(batch, length, c.num_heads, -1)
        k = (h @ w["attention.key.weight"].T).view(batch, length, c.num_kv_heads, -1)
        v = (h @ w["attention.value.weight"].T).view(batch, length, c.num_kv_heads, -1)
        source = c.source_of(layer)
        k, v = cached.setdefault(layer, (k, v)) if source is None else cached[source]
        if mla:  # k: the rope key, v: the latent, of the one cached "head"
            up_key = (v @ w["attention.up_key.weight"].T).view(batch, length, c.num_heads, -1)
            up_value = (v @ w["attention.up_value.weight"].T).view(batch, length, c.num_heads, -1)

            def key(b, s, head, k=k, up_key=up_key):
                return torch.cat((up_key[b, s, head], rotate(k[b, s, 0], s)))

            def value(b, s, head, up_value=up_value):
                return up_value[b, s, head]

            def query(b, p, head, q=q):
                nope = q[b, p, head, : c.nope_dim]
                return torch.cat((nope, rotate(q[b, p, head, c.nope_dim :], p)))
        else:

            def key(b, s, head, k=k):
                return rotate(k[b, s, head // group], s)

            def value(b, s, head, v=v):
                return v[b, s, head // group]

            def query(b, p, head, q=q):
                return rotate(q[b, p, head], p)

        mixed = torch.zeros(batch, length, c.num_heads, c.head_dim, dtype=torch.float64)
        for b in range(batch):
            for head in range(c.num_heads):
                for p in range(length):
                    first = max(0, p - window + 1)
                    asked = query(b, p, head)
                    scores = [
                        asked @ key(b, s, head) / math.sqrt(len(asked)) for s in range(first, p + 1)
                    ]
                    attention = torch.softmax(torch.stack(scores), dim=0)
                    mixed[b, p, head] = sum(
                        a * value(b, first + i, head) for i, a in enumerate(attention)
                    )
        x = x + mixed.reshape(batch, length, -1) @ w["attention.out.weight"].T
        h = rms_norm(x, w["ffn_norm.weight"])
        x = x + torch.nn.functional.silu(h @ w["ffn_in.weight"].T) @ w["ffn_out.weight"].T
    return rms_norm(x, weights["final_norm.weight"]) @ weights["embedding.weight"].T


@st.composite
def any_configs(draw, max_layers: int = 2) -> ModelConfig:
    """A model config: grouped-query or MLA (either path), with layers sharing caches or not."""
    with kvsizes.aiming_at(kvsizes.Sizes(supports=kvsizes.Domain(latent=True))):
        config = draw(kvst.model_configs(max_layers=max_layers), label="config")
    if config.num_layers > 1 and draw(st.booleans(), label="shared layers"):
        config = replace(config, kv_sources=draw(kvst.kv_sources(config), label="kv_sources"))
    return config


def test_an_mla_reader_up_projects_its_sources_latent_with_its_own_weights():
    # Contract 10.3: what layers share is the cache (the latent and the rope key); each
    # reader applies its own up-projections. Pinned: random draws reach this in few seeds.
    config = ModelConfig(
        vocab_size=11,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        attention="mla",
        latent_dim=6,
        rope_dim=4,
        nope_dim=2,
        kv_sources=(None, 0, 0),
    )
    model = kvtensors.build_model(config, torch.float64)
    tokens = kvtensors.random_tokens(config, 2, 5, seed=3)
    kvassert.assert_close_at(
        model(tokens),
        naive_logits(model, tokens),
        what="the model's and the naive transformer's logits",
        where="an uncached pass over 5 tokens of an MLA model whose last layers share the first's",
        position_axis=1,
    )


@given(data=st.data())
def test_agrees_with_a_naive_attention(data):
    config = data.draw(any_configs(max_layers=3), label="config")
    batch = data.draw(st.integers(1, 2), label="batch")
    length = data.draw(st.integers(1, 10), label="length")
    model = kvtensors.build_model(config, torch.float64)
    tokens = kvtensors.random_tokens(config, batch, length, seed=length)
    kvassert.assert_close_at(
        model(tokens),
        naive_logits(model, tokens),
        what="the model's and the naive transformer's logits",
        where=f"an uncached pass over {length} tokens",
        position_axis=1,
    )


@given(data=st.data())
def test_a_window_as_long_as_the_sequence_changes_nothing(data):
    config = data.draw(kvst.model_configs(max_layers=2), label="config")
    length = data.draw(st.integers(1, 12), label="length")
    window = data.draw(st.integers(length, length + 3), label="window")
    tokens = kvtensors.random_tokens(config, 2, length, seed=length)
    global_logits = kvtensors.build_model(replace(config, window=None), torch.float64)(tokens)
    windowed = kvtensors.build_model(replace(config, window=window), torch.float64)(tokens)
    assert torch.equal(global_logits, windowed), "a window covering every key changed logits"


def test_golden_checksum():
    """Pins the model's function: a refactor of kvref that changes any logit fails here."""
    config = ModelConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, seed=1234)
    model = ReferenceTransformer(config, dtype=torch.float64)
    logits = model(kvtensors.random_tokens(config, batch=2, length=12, seed=99))
    observed = [logits.sum().item(), logits.abs().sum().item(), *logits[1, -1, :3].tolist()]
    assert observed == pytest.approx(GOLDEN, rel=1e-9), (
        f"the reference model's logits moved: got {observed}, golden {GOLDEN}. If the change "
        "to kvref was meant to change the function, update GOLDEN and say why in the commit."
    )


# sum, sum of |logits|, and three logits of the last position (torch 2.13, CPU, float64);
# since token 0 embeds to zeros (its logit is 0: the output embedding is tied).
GOLDEN = [
    -171.07999842510938,
    7385.66912887197,
    0.0,
    4.8362537803728145,
    -8.29662676168749,
]


def warm_caches(factory=kvimpl.ConcatCache, window=None):
    config = ModelConfig(vocab_size=11, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=4)
    config = replace(config, window=window, window_layers="alternate")
    model = kvtensors.build_model(config, torch.float64)
    caches = model.new_caches(factory, batch=2, max_length=16)
    model(kvtensors.random_tokens(config, 2, 6, seed=1), caches=caches)
    return model, caches


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda m, c: m.truncate(c, -1), ValueError, "between 0 and 6"),
        (lambda m, c: m.truncate(c, 7), ValueError, "between 0 and 6"),
        (lambda m, c: m.truncate(c, 2.0), TypeError, "must be an int"),
        (lambda m, c: m.truncate(c[:2], 3), ValueError, "wrong number of caches"),
        (lambda m, c: m.reorder(c, torch.tensor([0, 2])), ValueError, r"in \[0, 2\)"),
        (lambda m, c: m.reorder(c, torch.tensor([0, 1], dtype=torch.int32)), ValueError, "int64"),
        (
            lambda m, c: m.reorder(c, torch.tensor([0, 1, 1])),
            ValueError,
            r"shape \(batch,\) = \(2,\)",
        ),
        (lambda m, c: m.reorder(c, [0, 1]), TypeError, "torch.Tensor"),
    ],
)
def test_truncate_and_reorder_of_every_layer_check_before_touching_any(call, error, message):
    model, caches = warm_caches()
    before = [(cache.key.clone(), cache.value.clone()) for cache in caches]
    with pytest.raises(error, match=message):
        call(model, caches)
    for layer, (cache, (key, value)) in enumerate(zip(caches, before, strict=True)):
        assert torch.equal(cache.key, key), f"layer {layer}'s keys changed"
        assert torch.equal(cache.value, value), f"layer {layer}'s values changed"


def test_a_cache_without_truncate_is_named():
    model, caches = warm_caches(examples_doubling.DoublingCache)
    with pytest.raises(CacheContractError, match=r"layer 0: DoublingCache offers no truncate\(\)"):
        model.truncate(caches, 3)


def test_window_layers_are_asked_first_so_a_refused_rewind_changes_no_layer():
    """Layers 0 and 2 have a window of 2, layer 1 is global: after 14 tokens the rings hold
    positions 7..13 only, so a rewind to 1 (whose next query needs position 0) is refused by
    layer 0 before the global layer, which could take it, has been touched."""
    model, caches = warm_caches(kvimpl.WindowCache, window=2)
    for token in range(8):
        model(torch.tensor([[token], [token]]), caches=caches)
    with pytest.raises(ValueError, match="gone"):
        model.truncate(caches, 1)
    lengths = [cache.length for cache in caches]
    assert lengths == [14, 14, 14], f"a refused rewind changed a layer: lengths {lengths}"


class AttendingConcat(kvimpl.ConcatCache):
    """A concat cache that also computes attention itself, with the reference function on
    the rows it holds: the model must take this route and give the same logits."""

    calls = 0

    def attend(self, query, key, value):
        keys, values = self.append(key, value)
        end = self.length
        positions = torch.arange(end - key.shape[2], end)
        AttendingConcat.calls += 1
        return kvref_attention(query, keys, values, positions, torch.arange(end), self.window)

    @property
    def window(self):
        return self.spec.window


def test_the_model_uses_attend_when_a_cache_offers_it():
    config = ModelConfig(num_heads=4, num_kv_heads=2, window=5, window_layers="alternate")
    model = ReferenceTransformer(config)
    tokens = kvtensors.random_tokens(config, 2, 12, seed=3)
    caches = model.new_caches(AttendingConcat, batch=2, max_length=12)
    before = AttendingConcat.calls
    logits = torch.cat(
        [model(tokens[:, :7], caches=caches), model(tokens[:, 7:], caches=caches)], 1
    )
    assert AttendingConcat.calls - before == 2 * config.num_layers, "attend was not called"
    kvassert.assert_close_at(
        logits, model(tokens), what="logits through attend", where="chunks 7+5", position_axis=1
    )


def test_an_attend_that_returns_the_wrong_shape_is_a_contract_error():
    class Truncating(AttendingConcat):
        def attend(self, query, key, value):
            return super().attend(query, key, value)[:, :, :, 1:]

    model = ReferenceTransformer(ModelConfig())
    caches = model.new_caches(Truncating, batch=1, max_length=4)
    with pytest.raises(CacheContractError, match="attend must return a tensor shaped like"):
        model(torch.zeros(1, 2, dtype=torch.int64), caches=caches)


@given(data=st.data())
def test_cached_calls_on_either_path_equal_the_uncached_model(data):
    # MLA's absorbed path and layers that share caches, chunk by chunk, against the
    # uncached pass: the model's part of what `logits` holds every cache to.
    config = data.draw(any_configs(max_layers=3), label="config")
    chunks = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=5), label="chunks")
    model = kvtensors.build_model(config, torch.float64)
    tokens = kvtensors.random_tokens(config, 2, sum(chunks), seed=len(chunks))
    caches = model.new_caches(kvimpl.ConcatCache, batch=2, max_length=sum(chunks))
    start, cached = 0, []
    for size in chunks:
        cached.append(model(tokens[:, start : start + size], caches=caches))
        start += size
    kvassert.assert_close_at(
        torch.cat(cached, dim=1),
        model(tokens),
        what="cached and uncached logits",
        where=f"chunks {chunks} of {kvst.describe_config(config)}",
        position_axis=1,
    )


def test_the_two_latent_paths_agree_to_rounding():
    config = ModelConfig(
        vocab_size=13, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=6, attention="mla"
    )
    tokens = kvtensors.random_tokens(config, 2, 9, seed=3)
    logits = []
    for path in ("naive", "absorbed"):
        model = ReferenceTransformer(replace(config, mla_path=path))
        caches = model.new_caches(kvimpl.ConcatCache, batch=2, max_length=9)
        logits.append(
            torch.cat([model(tokens[:, :5], caches=caches), model(tokens[:, 5:], caches=caches)], 1)
        )
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-12, atol=1e-12)
    spec = ReferenceTransformer(config).cache_spec(2, 9)
    assert (spec.kv_heads, spec.head_dim, spec.value_dim) == (1, 4, 16)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_kv_heads": 2, "num_heads": 4}, "num_kv_heads must be 1"),
        ({"rope_dim": 3}, "rope_dim must be even"),
        ({"latent_dim": 0}, "latent_dim must be an int >= 1"),
        ({"mla_path": "fast"}, "mla_path must be"),
    ],
)
def test_latent_configs_are_checked(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{"num_heads": 4, "num_kv_heads": 1, "attention": "mla", **change})


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        ((None, 1), "reads an earlier layer"),
        ((None, 0, 1), "which reads layer 0's cache itself"),
        ((0, None), "reads an earlier layer"),
        ((None,), "a tuple of 2 entries"),
    ],
)
def test_kv_sources_are_checked(sources, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(num_layers=max(2, len(sources)), kv_sources=sources)


def test_a_reader_must_share_its_sources_window():
    with pytest.raises(ValueError, match="another window"):
        ModelConfig(num_layers=2, window=4, window_layers="alternate", kv_sources=(None, 0))


def test_sharing_is_allowed_exactly_where_declared():
    shared = ReferenceTransformer(ModelConfig(num_layers=3, kv_sources=(None, None, 0)))
    caches = shared.new_caches(kvimpl.PreallocatedCache, batch=1, max_length=4)
    spec = shared.cache_spec(1, 4)
    assert [cache is None for cache in caches] == [False, False, True]
    tokens = torch.zeros(1, 2, dtype=torch.long)
    own = [*caches[:2], kvimpl.ConcatCache(shared.cache_spec(1, 4))]
    with pytest.raises(CacheContractError, match="layer 2 reads layer 0's cache"):
        shared(tokens, caches=own)
    with pytest.raises(CacheContractError, match="layer 1: no cache"):
        shared(tokens, caches=[caches[0], None, None])
    with pytest.raises(CacheContractError, match="same cache object"):
        shared(tokens, caches=[caches[0], caches[0], None])
    with pytest.raises(CacheContractError, match="layer 2 reads layer 0's cache"):
        shared.forward_rows(tokens, [2], [*caches[:2], kvimpl.PreallocatedCache(spec)])
    with pytest.raises(CacheContractError, match="layer 2 reads layer 0's cache"):
        shared.forward_tree(tokens, [-1, 0], [*caches[:2], kvimpl.ChunkedCache(spec)])
    unshared = ReferenceTransformer(ModelConfig(num_layers=2))
    with pytest.raises(CacheContractError, match="layer 1: no cache"):
        unshared(tokens, caches=[kvimpl.ConcatCache(unshared.cache_spec(1, 4)), None])
    assert all(cache.length == 0 for cache in caches if cache is not None)  # nothing written


@st.composite
def shared_configs(draw) -> ModelConfig:
    """A model of 2 to 4 layers, some reading an earlier layer's cache (windows, MLA)."""
    config = draw(any_configs(max_layers=4).filter(lambda config: config.num_layers > 1))
    if config.kv_sources is None:
        config = replace(config, kv_sources=draw(kvst.kv_sources(config), label="kv_sources"))
    return config


# A pinned model of each kind: MLA layers reading the first's latents beside a window, and
# grouped-query window layers alternating with global ones, each reading its own kind.
SHARED_MLA = ModelConfig(
    vocab_size=11, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=4, attention="mla",
    latent_dim=6, rope_dim=4, nope_dim=2, window=3, kv_sources=(None, None, 0, 1),
)  # fmt: skip
SHARED_WINDOWS = ModelConfig(
    vocab_size=13, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=4, window=4,
    window_layers="alternate", kv_sources=(None, None, 0, 1),
)  # fmt: skip


def assert_rows_equal_each_row_alone(config: ModelConfig, feeds, seed: int) -> None:
    """``forward_rows`` on a shared model, fed ``feeds`` (counts per row) on paged caches:
    each row's new logits are the uncached model's on that row alone (contract, 10.3)."""
    model = kvtensors.build_model(config, torch.float64)
    batch = len(feeds[0])
    caches = model.new_caches(kvimpl.CACHES["paged"], batch=batch, max_length=64)
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.empty(0, dtype=torch.long)] * batch
    for step, counts in enumerate(feeds):
        new = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in counts]
        laid, counts = rows_laid_out(new, "right")
        logits = model.forward_rows(laid, counts, caches)
        rows = [torch.cat((row, tokens)) for row, tokens in zip(rows, new, strict=True)]
        for row, count in enumerate(counts):
            if count:
                kvassert.assert_close_at(
                    logits[row : row + 1, :count],
                    model(rows[row][None])[:, -count:],
                    what=f"row {row}'s logits and that row's alone, uncached",
                    where=f"step {step}, rows fed {list(counts)}, {kvst.describe_config(config)}",
                    position_axis=1,
                    first_position=len(rows[row]) - count,
                )


def assert_tree_equals_each_path(config: ModelConfig, prefix: int, parents, path) -> None:
    """``forward_tree`` on a shared model after a prefix: each node's logits are the uncached
    model's on the prefix and the node's path; after ``commit_tree(path)`` on the source
    layers, a decode step is the uncached model's on the prefix, the path and the step."""
    model = kvtensors.build_model(config, torch.float64)
    caches = model.new_caches(kvimpl.CACHES["paged"], batch=2, max_length=64)
    history = kvtensors.random_tokens(config, 2, prefix, seed=prefix)
    nodes = kvtensors.random_tokens(config, 2, len(parents), seed=len(parents))
    model(history, caches=caches)
    model_said = kvst.describe_config(config)
    where = f"a tree of parents {list(parents)} after {prefix} tokens, {model_said}"
    kvassert.assert_close_at(
        model.forward_tree(nodes, parents, caches),
        model.forward_tree_uncached(history, nodes, parents),
        what="each node's logits and the uncached model's on the prefix and its path",
        where=where,
        position_axis=1,
    )
    for layer in config.cache_layers:  # a reader has no cache: it reads the commit
        caches[layer].commit_tree([path, path])
    step = kvtensors.random_tokens(config, 2, 1, seed=99)
    kvassert.assert_close_at(
        model(step, caches=caches),
        model(torch.cat((history, nodes[:, list(path)], step), dim=1))[:, -1:],
        what="the step after the commit and the uncached model's on the accepted tokens",
        where=f"{where}, path {list(path)} committed",
        position_axis=1,
    )


@pytest.mark.parametrize("config", [SHARED_MLA, SHARED_WINDOWS], ids=["mla", "windows"])
def test_shared_rows_and_trees_of_a_pinned_model_equal_the_uncached_pass(config):
    assert_rows_equal_each_row_alone(config, [(3, 5, 0), (1, 0, 2), (4, 1, 1), (1, 1, 1)], 1)
    assert_tree_equals_each_path(config, 5, (-1, 0, 0, 1, -1, 4), (0, 1, 3))


# A few draws in the default run (the pinned models above hold MLA and windows), more in soak.
@settings(max_examples=depth.pick(2, soak=40), deadline=None)
@given(data=st.data())
def test_shared_rows_and_trees_equal_the_uncached_pass(data):
    # Contract 10.3: a reader attends over its source's append_rows rows at each row's own
    # positions, and over its append_tree rows under the same tree mask.
    config = data.draw(shared_configs(), label="config")
    counts = st.lists(st.integers(0, 5), min_size=2, max_size=3)
    feeds = data.draw(st.lists(counts, min_size=1, max_size=3), label="feeds")
    feeds = [feed[: len(feeds[0])] + [1] * (len(feeds[0]) - len(feed)) for feed in feeds]
    assert_rows_equal_each_row_alone(config, feeds, seed=len(feeds))
    trees = {(-1,): [(), (0,)], (-1, 0, 0): [(0,), (0, 2)], (-1, -1, 1, 2): [(1, 2, 3), (0,)]}
    parents = data.draw(st.sampled_from(sorted(trees)), label="parents")
    path = data.draw(st.sampled_from(trees[parents]), label="path")
    prefix = data.draw(st.integers(1, 6), label="prefix")
    assert_tree_equals_each_path(config, prefix, parents, path)


@st.composite
def ragged_rows(draw):
    """What ``_attend_rows`` hands attention: B rows of slots, each row's valid ones a run at
    the start (right padding), at the end (left padding) or scattered (a cache that keeps
    its pads among its rows), at its own positions, with a window and sinks or without."""
    batch, slots = draw(st.integers(1, 4), label="batch"), draw(st.integers(1, 12), label="slots")
    kv_heads = draw(st.sampled_from((1, 2)), label="kv_heads")
    heads = kv_heads * draw(st.sampled_from((1, 2)), label="group")
    new = draw(st.integers(1, slots), label="new tokens")
    dtype = draw(st.sampled_from((torch.float32, torch.float64, torch.bfloat16)), label="dtype")
    layout = draw(st.sampled_from(("right", "left", "scattered")), label="layout")
    valid = torch.zeros(batch, slots, dtype=torch.bool)
    for row in range(batch):
        count = draw(st.integers(0, slots), label=f"row {row}'s valid slots")
        if layout == "scattered":
            chosen = draw(st.permutations(range(slots)), label=f"row {row}'s order")[:count]
            valid[row, list(chosen)] = True
        else:
            valid[row, row_slots(layout, slots, count)] = True
    window = draw(st.sampled_from((None, 2, 5)), label="window")
    sinks = draw(st.integers(0, 2), label="sinks") if window else 0
    generator = torch.Generator().manual_seed(draw(st.integers(0, 99), label="seed"))

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    keys, values = rand(batch, kv_heads, slots, 4), rand(batch, kv_heads, slots, 4)
    keys[~valid[:, None, :, None].expand_as(keys)] = float("nan")  # pads poisoned
    starts = torch.randint(0, 20, (batch,), generator=generator)
    key_positions = starts[:, None] + valid.cumsum(dim=1) - 1
    query_positions = key_positions[:, -1:] + 1 - new + torch.arange(new)
    sink_end = starts + sinks if sinks else None
    sink_query = rand(batch, heads, new, 4) if sinks else None
    query = rand(batch, heads, new, 4)
    return (query, keys, values, query_positions, key_positions, window), {
        "valid": valid,
        "sink_end": sink_end,
        "sink_query": sink_query,
    }


@given(case=ragged_rows())
def test_the_varlen_path_computes_what_the_dense_masked_path_does(case):
    args, kwargs = case
    dense = kvref_attention(*args, **kwargs)
    varlen = varlen_attention(kvref_attention, *args, **kwargs)
    # The same sums over fewer terms (no -inf scores, no zeroed values): equal within the
    # dtype's rounding, not always bit for bit (a reduction's blocking follows its length).
    # In bfloat16 the reference sums in float64 and rounds once, so there they agree bitwise.
    tolerance = {torch.bfloat16: 0, torch.float32: 1e-6, torch.float64: 1e-12}[dense.dtype]
    torch.testing.assert_close(varlen, dense, rtol=tolerance, atol=tolerance, equal_nan=True)


def test_the_varlen_path_never_reads_a_slot_that_is_not_valid():
    # A valid run from slot 1 to 2, a pad of nan before it and after it and one of inf in
    # another row's slots: the varlen path reads none of them, so nothing is masked to hide.
    valid = torch.tensor([[False, True, True, False], [True, True, True, True]])
    keys = torch.randn(2, 1, 4, 2, dtype=torch.float64)
    values = keys.clone()
    keys[0, :, [0, 3]], values[0, :, [0, 3]] = float("nan"), float("inf")
    positions = torch.tensor([[0, 0, 1, 0], [0, 1, 2, 3]])
    query = torch.randn(2, 1, 1, 2, dtype=torch.float64)
    seen = []

    def recording(query, keys, values, *args, **kwargs):
        seen.append(keys)
        return kvref_attention(query, keys, values, *args, **kwargs)

    at = (torch.tensor([[2], [4]]), positions)
    mixed = varlen_attention(recording, query, keys, values, *at, valid=valid)
    assert [tuple(k.shape) for k in seen] == [(1, 1, 2, 2), (1, 1, 4, 2)], seen
    assert mixed.isfinite().all(), mixed
    torch.testing.assert_close(mixed, kvref_attention(query, keys, values, *at, valid=valid))


class _CountsLatentAttends(LatentCache):
    calls = 0

    def attend_latent(self, query, key, value, scale):
        type(self).calls += 1
        return super().attend_latent(query, key, value, scale)


class _ReturnsTheQuery(LatentCache):
    def attend_latent(self, query, key, value, scale):
        super().attend_latent(query, key, value, scale)
        return query  # d_c + d_r wide: the rope channels too


MLA = ModelConfig(
    attention="mla", num_kv_heads=1, num_heads=4, head_dim=4, latent_dim=6, rope_dim=4,
    window=5, mla_path="absorbed",
)  # fmt: skip


def test_an_mla_layer_attends_through_attend_latent_and_checks_what_comes_back():
    model = kvtensors.build_model(MLA, torch.float64)
    tokens = kvtensors.random_tokens(MLA, 2, 12, seed=1)
    caches = model.new_caches(_CountsLatentAttends, batch=2, max_length=12)
    cached = torch.cat([model(tokens[:, :7], caches), model(tokens[:, 7:], caches)], dim=1)
    assert _CountsLatentAttends.calls == 2 * MLA.num_layers
    kvassert.assert_close_at(
        cached, model(tokens), what="logits", where="attend_latent", position_axis=1
    )
    caches = model.new_caches(_ReturnsTheQuery, batch=2, max_length=12)
    with pytest.raises(
        CacheContractError, match=r"layer 0: attend_latent must return .*\(2, 4, 3, 6\)"
    ):
        model(tokens[:, :3], caches)


def test_token_zero_writes_all_zero_rows_in_the_first_layer_only():
    # What a cache that reads lengths from its rows' contents mistakes for empty slots.
    config = ModelConfig(vocab_size=11, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4)
    model = ReferenceTransformer(config)
    _, rows = model.forward_with_kv(torch.tensor([[3, ZERO_TOKEN, 5]]))
    (keys, values), (later_keys, _) = rows
    assert not keys[:, :, 1].any()
    assert not values[:, :, 1].any()
    assert keys[:, :, 0].any()
    assert later_keys[:, :, 1].any()  # later layers mix in the tokens before it


@pytest.mark.parametrize("kind", kvtensors.TOKEN_KINDS)
def test_each_kind_of_tokens_writes_the_rows_it_names(kind):
    config = ModelConfig(vocab_size=11, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    tokens = kvtensors.tokens_of_kind(kind, config, 3, 8, seed=5)
    _, ((_, values),) = ReferenceTransformer(config).forward_with_kv(tokens)
    zero_rows = ~values.any(-1).any(1)  # (batch, position)
    assert zero_rows[:, ::2].all() == (kind == "padding")
    assert torch.equal(values[0], values[1]) == (kind in ("repeated", "rows alike"))
    assert torch.equal(values[0, :, 0], values[0, :, 1]) == (kind == "repeated")
