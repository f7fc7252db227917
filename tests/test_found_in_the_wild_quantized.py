"""Defects of Hugging Face transformers' quantized cache layers (kvimpl/hf_quantized.py).

Each test reproduces one finding directly on the transformers layer, with no part of the kit,
and asserts that the defect is there: it passes while the defect is there. Found with
transformers 5.24.0, optimum-quanto 0.2.7 and hqq 0.2.8.post1 (torch 2.13.0, CPU). The kit
found the first six on ``kvimpl.hf_quantized:HFQuantoLayer`` and ``HFQuantoLayerBeams``, and
the HQQ packing crash on ``HFHQQLayer`` with one group per token; the rest were found by hand,
where the kit cannot draw or declare them yet. The HQQ tests skip without ``hqq``.
"""

import pytest

pytest.importorskip(
    "transformers",
    reason="the quantized adapters need transformers: pip install 'kvcache-verify[hf-quantized]'",
)
pytest.importorskip(
    "optimum.quanto",
    reason="the quanto backend needs optimum-quanto: pip install 'kvcache-verify[hf-quantized]'",
)

import torch
from transformers import LlamaConfig
from transformers.cache_utils import (
    Fp8QuantizedLayer,
    HQQQuantizedLayer,
    QuantizedCache,
    QuantoQuantizedLayer,
)


def layer(**settings) -> QuantoQuantizedLayer:
    """A small quanto layer: int4 codes, groups of 4 (the whole head_dim below), and a
    full-precision residual flushed into codes when it reaches 4 rows."""
    return QuantoQuantizedLayer(**{"nbits": 4, "q_group_size": 4, "residual_length": 4, **settings})


def rows(tokens: int, batch: int = 1, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 1, tokens, 4, generator=generator).to(dtype)


def test_quantized_layer_counts_the_tokens_of_a_refused_update():
    """QuantizedLayer.update adds the new tokens to cumulative_length on its first line, before
    anything can fail: an update refused for a value of another batch leaves get_seq_length()
    counting a token never stored, as StaticLayer does (kit: "bad append [refusal changed
    state]: the cache: length is 2 after a refused call, was 1")."""
    cache = layer()
    cache.update(rows(1), rows(1))
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        cache.update(rows(1), rows(1, batch=2))
    assert cache.get_seq_length() == 2  # it holds 1


def test_quantized_layer_refused_first_update_breaks_it_until_reset():
    """The first update runs lazy_initialization (is_initialized = True) before it quantizes the
    prompt; when quantizing fails (here: zero tokens, which quanto cannot group; equally a value
    that is not a tensor, or a q_group_size that does not divide the prompt), no quantized
    states exist and every later update raises AttributeError until reset() (kit: "after
    refusing "zero new tokens", reading the cache back (an append of one valid row) raised
    AttributeError: 'NoneType' object has no attribute 'dequantize'")."""
    cache = layer()
    with pytest.raises(ValueError, match=r"Group size \(4\) must be a divisor of \(0\)"):
        cache.update(rows(0), rows(0))
    for _ in range(2):
        with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'dequantize'"):
            cache.update(rows(1), rows(1))
    cache.reset()
    keys, _ = cache.update(rows(1), rows(1))
    assert torch.equal(keys, rows(1))


def test_quantized_layer_accepts_keys_and_values_of_different_lengths():
    """update accepts a value with one token more than the key, empty or warm: from then on
    the layer returns more value rows than key rows, and get_seq_length() counts the keys'
    (kit: "value with one token more than key: accepted without an error")."""
    cache = layer()
    cache.update(rows(2), rows(2))
    keys, values = cache.update(rows(1), rows(2))
    assert (keys.shape[2], values.shape[2], cache.get_seq_length()) == (3, 4, 3)


def test_quantized_layer_silently_promotes_a_wrong_dtype():
    """The residual and the returned rows grow by torch.cat, which promotes: float64 rows given
    to a warm float32 layer are accepted, and every row it returns is float64 from then on
    (the next flush quantizes the history in float64), as DynamicLayer does (kit: "wrong
    dtype: accepted without an error")."""
    cache = layer()
    cache.update(rows(2), rows(2))
    keys, _ = cache.update(rows(1, dtype=torch.float64), rows(1, dtype=torch.float64))
    assert keys.dtype == torch.float64
    keys, _ = cache.update(rows(1), rows(1))
    assert keys.dtype == torch.float64


def test_quantized_layer_refuses_a_key_that_is_not_a_tensor_with_attribute_error():
    """update reads key_states.shape before anything else, so a list is refused with
    AttributeError rather than TypeError, the type the contract asks for (kit: "key not a
    tensor: refused with AttributeError, not TypeError or ValueError: 'list' object has no
    attribute 'shape'"). Nothing changes; only the type is wrong."""
    cache = layer()
    cache.update(rows(1), rows(1))
    with pytest.raises(AttributeError, match="'list' object has no attribute 'shape'"):
        cache.update([0.0, 0.0, 0.0, 0.0], rows(1))
    assert cache.get_seq_length() == 1


def test_quantized_layer_refused_reorder_breaks_it_until_reset():
    """reorder_cache stores the beam index for the quantized states (deferred to the next
    update) before it reorders the residual. An index the residual refuses (here: 1 in a batch
    of 1) stays pending, and every later update raises IndexError, counting its tokens each
    time (kit: "bad reorder [refusal changed state]: the cache: after refusing "negative
    index", reading the cache back (an append of one valid row) raised IndexError: index out
    of range in self"). With an empty residual (after the first update, or after a flush) the
    same index is not refused at all: the error surfaces at the next update."""
    cache = layer()
    cache.update(rows(1), rows(1))
    cache.update(rows(1), rows(1))  # the residual now holds one row
    with pytest.raises(IndexError, match="index out of range"):
        cache.reorder_cache(torch.tensor([1]))
    for length in (3, 4):
        with pytest.raises(IndexError, match="index out of range"):
            cache.update(rows(1), rows(1))
        assert cache.get_seq_length() == length  # it holds 2

    deferred = layer()
    deferred.update(rows(1), rows(1))  # the prompt is in codes, the residual is empty
    deferred.reorder_cache(torch.tensor([1]))  # accepted
    with pytest.raises(IndexError, match="index out of range"):
        deferred.update(rows(1), rows(1))


def test_quanto_groups_straddle_tokens_when_q_group_size_does_not_divide_head_dim():
    """Found by hand (the kit's declaration knows only groups inside one token): with the
    default q_group_size 64 and head_dim 96 (Phi-3-mini's), quanto groups runs of 64 numbers
    of the flattened (heads, tokens, head_dim) tensor, so one group holds token 0's last 32
    channels and token 1's first 32: a token's codes depend on its neighbour's values, and a
    large neighbour coarsens them. A single token of one head (96 numbers) cannot be grouped
    at all: the first update raises ValueError, and breaks the layer as above."""
    quiet = torch.linspace(-1.0, 1.0, 96).reshape(1, 1, 1, 96)
    loud = quiet.clone()
    loud[..., :32] = 10.0
    back = []
    for neighbour in (quiet, loud):
        cache = QuantoQuantizedLayer()  # HF's defaults: nbits 4, q_group_size 64
        prompt = torch.cat([quiet, neighbour], dim=2)
        cache.update(prompt, prompt)
        keys, _ = cache.update(quiet, quiet)  # the prompt comes back from its codes
        back.append(keys[0, 0, 0])
    assert not torch.equal(back[0], back[1])  # token 0 depends on token 1
    own_half_step = (quiet[0, 0, 0, 64:].amax() - quiet[0, 0, 0, 64:].amin()) / 15 / 2
    assert (back[1] - quiet[0, 0, 0])[64:].abs().max() > 4 * own_half_step

    single = QuantoQuantizedLayer()
    with pytest.raises(ValueError, match=r"Group size \(64\) must be a divisor of \(96\)"):
        single.update(quiet, quiet)


def test_hqq_default_axis_groups_numbers_across_batch_rows():
    """Found by hand: for the HQQ backend, axis 0 (HF's default axis_key and axis_value, the
    same default as for quanto) reshapes the flattened tensor to (q_group_size, -1) and takes
    min and max down each column: a group is numbers numel / q_group_size apart, across tokens,
    heads and batch rows. A sequence of large magnitude then coarsens the codes of another
    sequence in the same batch (here 80 times the error); HQQ's axis 1 (runs of q_group_size
    numbers, as quanto's axis 0) does not."""
    pytest.importorskip("hqq", reason="the HQQ backend needs hqq: pip install hqq")

    def error_of_row_0(axis: int, loud: bool) -> float:
        cache = HQQQuantizedLayer(
            nbits=4, axis_key=axis, axis_value=axis, q_group_size=4, residual_length=64
        )
        prompt = rows(8, batch=2)
        if loud:
            prompt[1] *= 100  # the other sequence of the batch, 100 times larger
        cache.update(prompt, prompt)
        keys, _ = cache.update(prompt[:, :, :1], prompt[:, :, :1])
        return (keys[0, :, :8] - prompt[0]).abs().max().item()

    assert error_of_row_0(0, loud=True) > 20 * error_of_row_0(0, loud=False)  # 7.1 against 0.09
    assert error_of_row_0(1, loud=True) == error_of_row_0(1, loud=False)


def test_hqq_axis_1_loses_codes_when_the_number_of_groups_is_odd():
    """The kit found it on HFHQQLayer with one group per token (kit: "logits [crash]:
    RuntimeError: shape '[1, 1, 1, 4]' is invalid for input of size 0"): along axis 1 HQQ's
    codes have one row per group, and its 4-bit packing (hqq.core.bitpack.pack_4bit_u8) ORs the
    first len // 2 rows into the rest, so an odd number of groups loses a row (one group: all
    of them). The update that quantizes returns, and every later update raises until reset()
    (and counts its tokens). A prompt of 1 or 3 tokens of one head, one group per token."""
    pytest.importorskip("hqq", reason="the HQQ backend needs hqq: pip install hqq")
    for tokens, message in ((1, r"is invalid for input of size 0"), (3, r"must match the size")):
        cache = HQQQuantizedLayer(
            nbits=4, axis_key=1, axis_value=1, q_group_size=4, residual_length=8
        )
        cache.update(rows(tokens), rows(tokens))  # the prompt is quantized: 1 or 3 groups
        for _ in range(2):
            with pytest.raises(RuntimeError, match=message):
                cache.update(rows(1), rows(1))
        assert cache.get_seq_length() == tokens + 2


def test_fp8_layer_clips_later_tokens_to_the_first_updates_range():
    """Found by hand (the kit declares integer codes only): Fp8QuantizedLayer freezes its
    per-tensor scale at the first update (absmax / 448) and casts later rows with it;
    torch's cast to float8_e4m3fn saturates at 448, so every later key or value beyond the
    prompt's largest magnitude comes back clipped to it, with no error. After a prompt of
    zeros the scale is float32's smallest normal and every later row comes back ~0."""
    cache = Fp8QuantizedLayer()
    prompt = torch.tensor([[[[0.5, -1.0, 0.25, 1.0]]]])
    cache.update(prompt, prompt)
    later = torch.tensor([[[[3.0, -4.0, 0.5, 10.0]]]])
    keys, _ = cache.update(later, later)
    assert keys[0, 0, 1].tolist() == [1.0, -1.0, 0.5, 1.0]

    zeros = Fp8QuantizedLayer()
    zeros.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
    keys, _ = zeros.update(later, later)
    assert keys[0, 0, 1].abs().max() < 1e-30


def test_quantized_cache_early_initialization_leaves_layers_that_cannot_update():
    """Found by hand: QuantizedLayer keeps supports_early_init = True from DynamicLayer, so
    Cache.early_initialization (the export path) initialises it with a zero-row tensor; but
    update builds the quantized states only on its lazy path, so the first update then raises
    AttributeError (counting its tokens). The fp8 backend raises already in
    early_initialization (amax of an empty tensor)."""
    config = LlamaConfig(
        num_hidden_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
    )
    cache = QuantizedCache("quanto", config, q_group_size=4, residual_length=4)
    cache.early_initialization(1, 1, 4, torch.float32, torch.device("cpu"))
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'dequantize'"):
        cache.update(rows(2), rows(2), 0)
    assert cache.get_seq_length() == 2

    fp8 = QuantizedCache("fp8", config)
    with pytest.raises(RuntimeError, match=r"amax\(\)"):
        fp8.early_initialization(1, 1, 4, torch.float32, torch.device("cpu"))
