"""transformers' generation path under the kit (kvimpl/hf_generate.py), and what it found.

A ``LlamaForCausalLM`` is given the reference model's weights (``llama_from_reference``) and
first shown to compute the reference model's logits uncached. Then: the engine adapters
under ``EngineTests``; ``generate`` itself, its logits held row by row and step by step to
the same prompt generated alone and to the uncached oracle over prompt + generated tokens
(batched left-padded generation with the dynamic and the static cache, assisted generation
and prompt lookup, whose rejected candidates are cropped); and one test per finding, each
asserting that the kit's check FAILS with the message the kit printed, so that it passes
while the defect is there. Found with transformers 5.24.0 (torch 2.13.0, CPU);
docs/found-in-the-wild.md has the details, repros/generate_*.py the standalone repros.
"""

import functools

import pytest

pytest.importorskip(
    "transformers", reason="the adapters need transformers: pip install 'kvcache-verify[hf]'"
)

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, StaticCache

from kvcheck import asserts as kvassert
from kvcheck import failures
from kvcheck.engines import EngineTests
from kvimpl.hf_generate import (
    HFGenerateEngine,
    HFGenerateEngineCrop,
    HFGenerateEngineEager,
    llama_from_reference,
)
from kvref import ModelConfig, ReferenceTransformer

CONFIG = ModelConfig(
    vocab_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=24, ffn="swiglu"
)
DRAFT = ModelConfig(
    vocab_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, ffn_dim=16, ffn="swiglu"
)
PAD = CONFIG.vocab_size - 1  # prompts are drawn below it: generate masks a pad id it meets
GREEDY = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=PAD)
SMALL = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)


@functools.cache
def truth() -> ReferenceTransformer:
    return ReferenceTransformer(CONFIG, dtype=torch.float64)


@functools.cache
def llama(dtype=torch.float32, attn="sdpa"):
    return llama_from_reference(truth(), dtype=dtype, attn_implementation=attn)


@functools.cache
def draft():
    return llama_from_reference(ReferenceTransformer(DRAFT, dtype=torch.float32))


def oracle_rows(prompt: list[int], generated: list[int]) -> torch.Tensor:
    """The uncached model's logits for each generated token's step: the row of the token
    before it, over prompt + generated, in float64."""
    tokens = torch.tensor([prompt + generated])
    return truth()(tokens)[0, len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def step_logits(out, row: int) -> torch.Tensor:
    return torch.stack([step[row] for step in out.logits]).to(torch.float64)


def assert_steps_close(actual, expected, *, what: str, row: int, dtype=torch.float32) -> None:
    """Each generated step's logits (steps on axis 0) at ``dtype``'s tolerance."""
    kvassert.assert_close_at(
        actual.to(dtype),
        expected.to(dtype),
        what=what,
        where=f"batch row {row}, by generated step",
        position_axis=0,
    )


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


prompt_tokens = st.lists(st.integers(0, PAD - 1), min_size=1, max_size=6)


# --- the weights ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_llama_computes_the_reference_model_uncached(dtype):
    """transformers' Llama with the reference model's weights gives its uncached logits, at
    positions from 0 and at positions with gaps (float32's tolerance even in float64:
    transformers computes RMSNorm, RoPE and the softmax in float32)."""
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    hf = llama(dtype)
    kvassert.assert_close_at(
        hf(tokens).logits.to(torch.float32),
        truth()(tokens).to(torch.float32),
        what="transformers' and the reference model's logits",
        where="uncached",
        position_axis=1,
    )
    positions = torch.tensor([0, 1, 2, 6, 7, 9, 20, 21, 40])
    kvassert.assert_close_at(
        hf(tokens[:1], position_ids=positions[None]).logits[0].to(torch.float32),
        truth()(tokens[:1], positions=positions)[0].to(torch.float32),
        what="transformers' and the reference model's logits",
        where="uncached, positions with gaps",
        position_axis=0,
    )


# --- the engines under the kit -------------------------------------------------------


class TestHFGenerateEngine(EngineTests):
    """One DynamicCache per sequence, sdpa attention (transformers' default)."""

    engine = HFGenerateEngine


class TestHFGenerateEngineEager(EngineTests):
    """The same with eager attention."""

    engine = HFGenerateEngineEager


class TestHFGenerateEngineCrop(EngineTests):
    """``DynamicCache.crop`` as the kit's remove: of a tail alone, the one transformers has."""

    engine = HFGenerateEngineCrop
    removes = ("tail", "past the end")


# --- generate --------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@SMALL
@given(
    prompts=st.lists(prompt_tokens, min_size=1, max_size=3),
    new=st.integers(1, 4),
    chunk=st.sampled_from([None, 1, 2, 3]),
)
def test_batched_left_padded_generate_matches_each_row_alone_and_the_oracle(
    cache, prompts, new, chunk
):
    """Each row of a batched, left-padded greedy generate (its prompt prefilled whole, or in
    chunks: ``prefill_chunk_size``): its logits at every step equal the same prompt generated
    alone and the uncached model over prompt + generated tokens."""
    hf = llama()
    ids, mask = left_padded(prompts)
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new,
        cache_implementation=cache,
        prefill_chunk_size=chunk,
        **GREEDY,
    )
    width = ids.shape[1]
    for row, prompt in enumerate(prompts):
        generated = out.sequences[row, width:].tolist()
        got = step_logits(out, row)
        assert_steps_close(
            got, oracle_rows(prompt, generated), what="generate's and the oracle's logits", row=row
        )
        alone = hf.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new,
            cache_implementation=cache,
            **GREEDY,
        )
        same = 0  # the steps until the two chose different tokens (a near tie, at most)
        while same < new and alone.sequences[0, len(prompt) + same] == generated[same]:
            same += 1
        steps = min(same + 1, new)
        assert_steps_close(
            got[:steps],
            step_logits(alone, 0)[:steps],
            what="the batched row's and the prompt alone's logits",
            row=row,
        )


@pytest.mark.parametrize("assist", ["assistant_model", "prompt_lookup_num_tokens"])
@SMALL
@given(prompt=prompt_tokens, repeat=st.booleans(), new=st.integers(1, 6))
def test_assisted_generation_equals_greedy_and_matches_the_oracle(assist, prompt, repeat, new):
    """Assisted generation (a draft model, or prompt lookup) crops its cache after each
    rejected candidate: its tokens equal plain greedy decoding's and each step's logits the
    uncached model's over prompt + generated tokens. A repeated prompt gives prompt lookup
    candidates to accept."""
    prompt = prompt + prompt if repeat else prompt
    hf = llama()
    inputs = dict(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=new,
        **GREEDY,
    )
    plain = hf.generate(**inputs)
    extra = {"assistant_model": draft()} if assist == "assistant_model" else {assist: 2}
    out = hf.generate(**inputs, **extra)
    generated = out.sequences[0, len(prompt) :].tolist()
    assert_steps_close(
        step_logits(out, 0),
        oracle_rows(prompt, generated),
        what="assisted generate's and the oracle's logits",
        row=0,
    )
    assert out.sequences.tolist() == plain.sequences.tolist()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_batched_beam_search_scores_match_the_oracle(cache):
    """Beam search reorders its cache (reorder_cache) at every step: with no length penalty,
    each returned sequence's score is the oracle's log-probability of its tokens."""
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    ids, mask = left_padded(prompts)
    out = llama().generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=4,
        num_beams=3,
        num_return_sequences=3,
        length_penalty=0.0,
        early_stopping=False,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        pad_token_id=PAD,
        cache_implementation=cache,
    )
    width = ids.shape[1]
    scores = []
    for row in range(len(prompts) * 3):
        prompt, generated = prompts[row // 3], out.sequences[row, width:].tolist()
        logprobs = torch.log_softmax(oracle_rows(prompt, generated), dim=-1)
        scores.append(sum(logprobs[step, token] for step, token in enumerate(generated)))
    kvassert.assert_close_at(
        out.sequences_scores.to(torch.float32),
        torch.stack(scores).to(torch.float32),
        what="beam search's and the oracle's sequence scores",
        where="by returned sequence",
        position_axis=0,
    )


def test_assisted_generation_refuses_a_batch_clearly():
    """Assisted generation and prompt lookup refuse a batch of 2 before any work, with a
    message that says why (transformers 5.24.0)."""
    ids, mask = left_padded([[1, 2], [3, 4, 5]])
    for extra in ({"assistant_model": draft()}, {"prompt_lookup_num_tokens": 2}):
        with pytest.raises(ValueError, match="only supported for batch_size = 1"):
            llama().generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=2, **GREEDY, **extra
            )


def test_generate_continues_a_conversation_on_its_own_cache():
    """The documented reuse: the second call's input is the first's output and more, so the
    cache holds a prefix of it; both caches continue correctly."""
    hf = llama()
    for cache in (DynamicCache(config=hf.config), StaticCache(config=hf.config, max_cache_len=16)):
        first = hf.generate(
            input_ids=torch.tensor([[1, 2, 3, 4]]), max_new_tokens=3, cache=cache, **GREEDY
        )
        more = torch.cat([first.sequences, torch.tensor([[7, 8]])], dim=1)
        out = hf.generate(input_ids=more, max_new_tokens=3, cache=cache, **GREEDY)
        prompt = more[0].tolist()
        assert_steps_close(
            step_logits(out, 0),
            oracle_rows(prompt, out.sequences[0, len(prompt) :].tolist()),
            what="the continued generate's and the oracle's logits",
            row=0,
        )


# --- the findings ----------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_float64_eager_attention_turns_padded_rows_into_nan(cache):
    """Finding 1. A float64 Llama with eager attention gives NaN logits for every left-padded
    row of a batch: the pad mask is finfo(float64).min, which the softmax's cast to float32
    turns into -inf, so a pad query's row is all -inf, its softmax NaN, and the NaN keys it
    leaves reach every query of its row in the next layer (transformers 5.24.0)."""
    hf = llama(torch.float64, "eager")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    ids, mask = left_padded(prompts)
    out = hf.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=2, cache_implementation=cache, **GREEDY
    )
    got = step_logits(out, 0)
    assert torch.isnan(got).all()  # the padded row; the unpadded one is finite
    assert not torch.isnan(step_logits(out, 1)).any()
    with pytest.raises(failures.WrongResults, match=r"generate's and the oracle's logits differ"):
        kvassert.assert_close_at(
            got,
            oracle_rows(prompts[0], out.sequences[0, ids.shape[1] :].tolist()),
            what="generate's and the oracle's logits",
            where="batch row 0, by generated step",
            position_axis=0,
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the finding is of a CPU-only torch")
def test_offloaded_cache_crashes_on_a_cpu_only_torch():
    """Finding 2. cache_implementation="offloaded" is accepted on a CPU model, then its
    first update calls torch.cuda.default_stream, which raises torch's own AssertionError
    (cache_utils.py:1614, transformers 5.24.0): no clear refusal, and nothing falls back."""
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        llama().generate(
            input_ids=ids, max_new_tokens=2, cache_implementation="offloaded", **GREEDY
        )
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        llama()(ids, cache=DynamicCache(config=llama().config, offloading=True))


@pytest.mark.parametrize("kind", ["DynamicCache", "StaticCache"])
def test_a_reused_cache_silently_serves_another_prompt(kind):
    """Finding 3. generate trusts that the cache it is given holds a prefix of input_ids: a
    cache left holding 6 tokens of another prompt makes it skip the first 6 tokens of a new,
    unrelated 9-token prompt and attend to the old ones. The logits are wrong, with no error
    (a shorter new prompt fails with an unrelated reshape error instead; transformers
    5.24.0)."""
    hf = llama()
    cache = (
        DynamicCache(config=hf.config)
        if kind == "DynamicCache"
        else StaticCache(config=hf.config, max_cache_len=32)
    )
    hf.generate(input_ids=torch.tensor([[1, 2, 3, 4]]), max_new_tokens=3, cache=cache, **GREEDY)
    prompt = list(range(9, 18))
    out = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=3, cache=cache, **GREEDY)
    with pytest.raises(failures.WrongResults, match=r"generate's and the oracle's logits differ"):
        assert_steps_close(
            step_logits(out, 0),
            oracle_rows(prompt, out.sequences[0, len(prompt) :].tolist()),
            what="generate's and the oracle's logits",
            row=0,
        )
    with pytest.raises(RuntimeError, match="cannot reshape tensor of 0 elements"):
        hf.generate(input_ids=torch.tensor([[5, 6]]), max_new_tokens=2, cache=cache, **GREEDY)


def test_a_static_cache_too_short_fails_mid_generation_and_stays_broken():
    """Finding 4. generate does not hold a StaticCache it is given to prompt + max_new_tokens:
    with room for 5 of the 6 tokens it must hold, it generates, then raises IndexError from
    index_copy_ at the overflowing step (its output lost) and leaves the cache counting 6
    tokens in 5 slots, so every later call fails until reset() (StaticLayer counts before
    it writes: docs/found-in-the-wild.md, finding 1; transformers 5.24.0)."""
    hf = llama()
    cache = StaticCache(config=hf.config, max_cache_len=5)
    with pytest.raises(IndexError, match=r"index 5 is out of bounds for dimension 2 with size 5"):
        hf.generate(input_ids=torch.tensor([[1, 2, 3, 4]]), max_new_tokens=3, cache=cache, **GREEDY)
    assert int(cache.get_seq_length()) == 6  # in 5 slots


def test_a_float64_llama_is_only_float32_accurate():
    """Finding 5. transformers' RMSNorm casts its input to float32, RoPE's cos and sin come
    from float32 angles and eager attention takes its softmax in float32: upcasts for half
    precision, downcasts for float64. A float64 Llama is then float32-accurate, and the
    kit's float64 judgement fails it (the adapters declare float32; transformers 5.24.0)."""
    tokens = torch.randint(0, CONFIG.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([[0, 1, 2, 3, 500, 1000, 2000, 3000, 4000]])
    with pytest.raises(
        failures.WrongResults, match=r"transformers' and the reference model's logits differ"
    ):
        kvassert.assert_close_at(
            llama(torch.float64, "eager")(tokens, position_ids=positions).logits[0],
            truth()(tokens, positions=positions[0])[0],
            what="transformers' and the reference model's logits",
            where="uncached, in float64",
            position_axis=0,
        )
