"""pagedkv as the prompt cache of mlx-lm, on mlx-lm's own model code (issue 12).

Every parity test compares greedy tokens and the full-vocabulary logprobs *bytes* of a paged
request with mlx-lm's own ``KVCache`` doing the same work (a fresh run of the whole prompt
when the paged request reused a prefix). Models are mlx-lm architectures built from tiny
config dicts with seeded random weights; nothing is downloaded.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm", reason="pip install 'pagedkv[mlx-lm]'")

from mlx_lm.generate import (
    batch_generate,
    speculative_generate_step,
    stream_generate,
)
from mlx_lm.models.cache import (
    LRUPromptCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_lm_support import (
    Steps,
    fresh,
    laid_out_as_computed,
    model_of,
    on_cpu,
    reused,
    run,
    toks,
)
from pagedkv.errors import (
    CapacityExceeded,
    InvalidArgument,
    InvalidArgumentType,
    PoolExhausted,
    RequestClosed,
)
from pagedkv.integrations.mlx_lm import (
    PagedKVLayerCache,
    PagedPromptCache,
)
from pagedkv.integrations.mlx_lm.parity import exact_backend
from pagedkv.integrations.mlx_lm.random_models import random_model, word_tokenizer

BS = 8  # block size: short prompts still span several blocks


# --- parity -------------------------------------------------------------------------------

CONVERSATION_CASES = [(a, d) for a in ("qwen3", "llama") for d in ("float32", "bfloat16",
                                                                   "float16")]
CONVERSATION_CASES += [(a, "float32") for a in ("qwen2", "mistral", "phi3", "gemma2")]


@pytest.mark.parametrize("arch,dtype", CONVERSATION_CASES)
def test_prompt_conversation_and_shared_prefix_match_kvcache(arch, dtype):
    model = model_of(arch, dtype)
    paged = PagedPromptCache(model, block_size=BS)
    assert paged.geometry.dtype == dtype
    p1 = toks(40, 1)

    # A: one prompt, nothing cached.
    ref_cache = make_prompt_cache(model)
    ref_a = run(model, p1, ref_cache)
    a = paged.begin(p1)
    assert a.cached_tokens == 0
    got_a = run(model, p1, a.cache)
    assert got_a == ref_a
    held = p1 + got_a[0]
    assert a.cache[0].offset == len(held)
    assert a.end(held) == len(held)  # every position went to the pool

    # B: the next turn of the conversation continues the parked table, tail block included.
    p2 = held + toks(12, 2)
    ref_b = run(model, p2[len(held):], ref_cache)
    b = paged.begin(p2)
    assert b.cached_tokens == len(held) == 46  # not a multiple of the block size
    got_b = run(model, p2[b.cached_tokens:], b.cache)
    assert got_b == ref_b
    b.end(p2 + got_b[0])

    # C: a new request sharing 3 blocks with A equals a fresh run of its whole prompt.
    p3 = p1[:3 * BS] + toks(10, 3)
    c = paged.begin(p3)
    assert c.cached_tokens == 3 * BS
    got_c = run(model, p3[c.cached_tokens:], c.cache)
    assert got_c == reused(model, p1, 6, 3 * BS, p3)
    if on_cpu():
        assert got_c == fresh(model, p3)
    s = paged.stats()
    assert s["hit_tokens"] == 46 + 24 and s["continued_tokens"] == 46
    assert s["blocks_shared"] == 3  # C and the parked conversation hold A's first 3 blocks
    c.release()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_chunked_prefill_with_pool_growth(dtype):
    model = model_of("qwen3", dtype)
    paged = PagedPromptCache(model, block_size=BS, initial_blocks=2, max_blocks=64)
    p = toks(70, 4)
    r = paged.begin(p)
    got = run(model, p, r.cache, prefill_step_size=16)
    assert got == fresh(model, p, prefill_step_size=16)
    r.end(p + got[0])
    s = paged.stats()
    assert s["grow_events"] >= 1 and s["pool_blocks"] >= 10
    # What was published before and during growth is intact: a hit equals a fresh run.
    q = p[:64] + toks(9, 5)
    r2 = paged.begin(q)
    assert r2.cached_tokens == 64
    got = run(model, q[64:], r2.cache, prefill_step_size=16)
    assert got == reused(model, p, 6, 64, q, first_kwargs={"prefill_step_size": 16},
                         prefill_step_size=16)
    if on_cpu():
        assert got == fresh(model, q)
    r2.release()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_trim_then_continue_and_publish_never_writes_a_shared_block(dtype):
    model = model_of("qwen3", dtype)
    paged = PagedPromptCache(model, block_size=BS)
    p = toks(30, 6)
    ref_cache = make_prompt_cache(model)
    r = paged.begin(p)
    out1 = run(model, p, r.cache, n=8)
    assert out1 == run(model, p, ref_cache, n=8)
    assert trim_prompt_cache(r.cache, 5) == trim_prompt_cache(ref_cache, 5) == 5
    more = toks(6, 7)
    out2 = run(model, more, r.cache)
    assert out2 == run(model, more, ref_cache)
    held = p + out1[0][:3] + more + out2[0]
    assert r.cache[0].offset == len(held)
    r.end(held)

    # Trim a request below the 3 shared blocks it got from the pool, then diverge: its
    # publication must start over from a lookup, never write into the shared third block.
    q = p[:3 * BS] + toks(10, 8)
    r2 = paged.begin(q)
    assert r2.cached_tokens == 3 * BS
    out_q = run(model, q[r2.cached_tokens:], r2.cache)
    trim_prompt_cache(r2.cache, r2.cache[0].offset - 20)
    x = toks(8, 9)
    out_x = run(model, x, r2.cache, n=4)
    ref2 = make_prompt_cache(model)  # mlx-lm reusing A's first 24 tokens, as r2 did
    run(model, p, ref2, n=8)
    trim_prompt_cache(ref2, ref2[0].offset - 3 * BS)
    run(model, q[3 * BS:], ref2)
    trim_prompt_cache(ref2, ref2[0].offset - 20)
    assert out_x == run(model, x, ref2, n=4)
    held2 = q[:20] + x + out_x[0]
    r2.end(held2)
    assert out_q[0]  # generated something before the trim

    s = p[:3 * BS] + toks(5, 10)  # the shared blocks are intact
    r3 = paged.begin(s)
    assert r3.cached_tokens == 3 * BS
    got = run(model, s[r3.cached_tokens:], r3.cache)
    assert got == reused(model, p, 8, 3 * BS, s)
    if on_cpu():
        assert got == fresh(model, s)
    r3.release()
    t = held2 + toks(3, 11)  # and the trimmed conversation was published as it ended
    r4 = paged.begin(t)
    assert r4.cached_tokens == len(held2)
    got = run(model, t[r4.cached_tokens:], r4.cache)
    assert got == run(model, t[len(held2):], ref2)  # mlx-lm continuing its own caches
    if on_cpu():
        assert got == fresh(model, t)
    r4.release()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_speculative_decoding_with_a_draft_model(dtype):
    from mlx.utils import tree_map

    model = model_of("qwen3", dtype)
    draft = random_model("qwen3", seed=0)[0]  # the same weights plus noise: some drafts fail
    draft.update(tree_map(lambda w: w + 0.02 * mx.random.normal(w.shape, key=mx.random.key(1)),
                          draft.parameters()))
    draft.set_dtype(getattr(mx, dtype))
    p = toks(40, 12)

    def spec(cache):
        return [(int(t), np.array(lp.astype(mx.float32)).tobytes(), bool(d)) for t, lp, d in
                speculative_generate_step(mx.array(p), model, draft, prompt_cache=cache,
                                          max_tokens=12, num_draft_tokens=3)]

    ref_cache = make_prompt_cache(model) + make_prompt_cache(draft)
    ref = spec(ref_cache)
    paged = PagedPromptCache(model, block_size=BS)
    r = paged.begin(p)
    got = spec(r.cache + make_prompt_cache(draft))
    assert got == ref
    assert 0 < sum(d for _, _, d in got) < len(got)  # drafts accepted and rejected (trims)
    held = p + [t for t, _, _ in got]
    n = r.cache[0].offset  # the last token may or may not have been fed back
    assert n == ref_cache[0].offset and len(held) - 1 <= n <= len(held)
    r.end(held[:n])
    q = held[:n] + toks(4, 13)
    r2 = paged.begin(q)
    assert r2.cached_tokens == n
    got = run(model, q[n:], r2.cache)
    assert got == run(model, q[n:], ref_cache[:len(r.cache)])
    if on_cpu():
        assert got == fresh(model, q)
    r2.release()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_fork_through_lru_prompt_cache(dtype):
    model = model_of("qwen3", dtype)
    paged = PagedPromptCache(model, block_size=BS)
    p = toks(27, 14)
    r = paged.begin(p)
    out = run(model, p, r.cache)
    ref = make_prompt_cache(model)
    assert run(model, p, ref) == out
    held = p + out[0]

    ours, theirs = LRUPromptCache(), LRUPromptCache()
    ours.insert_cache("m", held, r.cache)
    theirs.insert_cache("m", held, ref)
    assert ours.nbytes == sum(c.nbytes for c in r.cache) > 0

    # Exact-then-longer prompt: LRUPromptCache deep-copies the entry (our fork).
    q = held + toks(7, 15)
    fork, rest = ours.fetch_nearest_cache("m", q)
    ref_fork, ref_rest = theirs.fetch_nearest_cache("m", q)
    assert rest == ref_rest == q[len(held):]
    assert isinstance(fork[0], PagedKVLayerCache) and fork[0].request is not r
    assert fork[0].request is fork[-1].request  # one fork per deep copy, not one per layer
    # A shorter prompt: LRUPromptCache copies the longer entry and trims it.
    short = held[:20] + toks(3, 17)
    trimmed, short_rest = ours.fetch_nearest_cache("m", short)
    ref_trimmed, ref_short_rest = theirs.fetch_nearest_cache("m", short)
    assert short_rest == ref_short_rest == short[20:]
    assert trimmed[0].offset == ref_trimmed[0].offset == 20

    out_fork = run(model, rest, fork)
    assert out_fork == run(model, ref_rest, ref_fork)
    assert run(model, short_rest, trimmed) == run(model, ref_short_rest, ref_trimmed)
    # The original is untouched by its copies' writes and continues on its own.
    other = toks(5, 16)
    out_other = run(model, other, r.cache)
    assert out_other == run(model, other, ref)
    s = paged.stats()
    assert s["forks"] == 2 and s["live_requests"] == 3

    r.end(held + other + out_other[0])
    fork[0].request.end(q + out_fork[0])
    trimmed[0].request.release()
    s = paged.stats()
    assert s["live_requests"] == 0 and s["parked"] == 2


def test_stream_generate_with_a_tokenizer():
    model = model_of()
    tokenizer = TokenizerWrapper(word_tokenizer(256))
    paged = PagedPromptCache(model, block_size=BS)
    system = " ".join(f"w{i}" for i in toks(24, 18))
    prompts = [tokenizer.encode(f"{system} w{i} w{i + 1}") for i in (3, 9)]

    def as_steps(streamed):
        return Steps([t for _, t, _ in streamed], b"".join(lp for _, _, lp in streamed),
                     dtype="float32", same_calls=False)

    def stream(prompt, cache):
        return [(r.text, r.token, np.array(r.logprobs).tobytes())
                for r in stream_generate(model, tokenizer, prompt, max_tokens=6,
                                         prompt_cache=cache)]

    for i, prompt in enumerate(prompts):
        request = paged.begin(prompt)
        assert request.cached_tokens == (0 if i == 0 else 24)
        got = stream(prompt[request.cached_tokens:], request.cache)
        ref = stream(prompt, make_prompt_cache(model))
        # the text and tokens with the parity rule (the rule is byte equality on MLX's CPU)
        assert as_steps(got) == as_steps(ref)
        if exact_backend():
            assert got == ref
        request.end(prompt + [t for _, t, _ in got])


def test_batch_generate_merges_paged_caches_and_insert_publishes():
    model = model_of()
    tokenizer = TokenizerWrapper(word_tokenizer(256))
    paged = PagedPromptCache(model, block_size=BS)
    shared = toks(48, 19)
    prompts = [shared + toks(k, 20 + k) for k in (7, 12, 3)]
    first = paged.begin(prompts[0])
    first.end(prompts[0] + run(model, prompts[0], first.cache, n=4)[0])

    requests = [paged.begin(p) for p in prompts]
    assert [r.cached_tokens for r in requests] == [48, 48, 48]
    tails = [p[r.cached_tokens:] for p, r in zip(prompts, requests)]
    got = batch_generate(model, tokenizer, tails, prompt_caches=[r.cache for r in requests],
                         max_tokens=6, return_prompt_caches=True, return_token_ids=True,
                         return_logprobs=True)
    # mlx-lm's own batch over KVCaches that hold the same prefixes.
    ref_caches = []
    for p, r in zip(prompts, requests):
        cache = make_prompt_cache(model)  # the prefix as the first request computed it
        run(model, prompts[0], cache, n=4)
        trim_prompt_cache(cache, cache[0].offset - r.cached_tokens)
        ref_caches.append(cache)
    ref = batch_generate(model, tokenizer, tails, prompt_caches=ref_caches, max_tokens=6,
                         return_token_ids=True, return_logprobs=True,
                         return_prompt_caches=True)
    assert got.token_ids == ref.token_ids and got.logprobs == ref.logprobs
    # The batch owns copies: the paged requests were handed over and hold no blocks.
    assert all(r.state == "handed over to a batch" for r in requests)
    with pytest.raises(RequestClosed):
        requests[0].end(prompts[0])

    before = paged.stats()
    bad = got.caches[0]
    with pytest.raises(InvalidArgument, match="holds"):
        paged.insert(prompts[0], bad)  # the cache also holds the generated tokens
    assert paged.stats() == before
    for p, ids, cache, own in zip(prompts, got.token_ids, got.caches, ref.caches):
        held = p + ids[:cache[0].offset - len(p)]
        written = paged.insert(held, cache)
        assert written == len(held) - (48 if p is not prompts[0] else 56)
        tail = held + toks(3, 30)
        r = paged.begin(tail)
        assert r.cached_tokens == len(held)  # continues the inserted conversation exactly
        got_tail = run(model, tail[len(held):], r.cache)
        # mlx-lm continuing its batch's cache. prompts[0]'s first 56 tokens come from the
        # blocks its first request published (one prefill call, then decode steps), which
        # the batch computed again in other calls: byte-equal on CPU, bounded on GPUs.
        own_tail = run(model, tail[len(held):], laid_out_as_computed(own),
                       same_calls=p is not prompts[0])
        assert got_tail == own_tail
        if on_cpu():
            assert got_tail == fresh(model, tail)
        r.release()


_RESTORE_CHILD = r"""
import json, sys
import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from pagedkv.integrations.mlx_lm import PagedPromptCache
from pagedkv.integrations.mlx_lm.random_models import random_model
model = random_model("qwen3", seed=0)[0]
prompt, first = json.loads(sys.argv[2]), json.loads(sys.argv[3])
def run(p, cache):
    return [(int(t), mx.array(lp).tolist()) for t, lp in
            generate_step(mx.array(p), model, prompt_cache=cache, max_tokens=6)]
with PagedPromptCache(model, block_size=8, cold_dir=sys.argv[1]) as paged:
    request = paged.begin(prompt)
    got = run(prompt[request.cached_tokens:], request.cache)
    stats = paged.stats()
# mlx-lm reusing the parent's first run (its prompt and 6 tokens) up to what was restored
ref = make_prompt_cache(model)
run(first, ref)
trim_prompt_cache(ref, ref[0].offset - request.cached_tokens)
print(json.dumps({"restored": request.restored_tokens, "cached": request.cached_tokens,
                  "same": got == run(prompt[request.cached_tokens:], ref),
                  "cold_hits": stats["cold_hits"], "corruptions": stats["cold_corruptions"]}))
"""


def test_restart_restores_a_shared_prefix_from_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_PERSIST_PAGED_CACHE", "1")
    model = model_of()
    cold = tmp_path / "cold"
    p = toks(40, 31)
    with PagedPromptCache(model, block_size=BS, cold_dir=cold) as paged:
        r = paged.begin(p)
        r.end(p + run(model, p, r.cache)[0])
        assert paged.stats()["cold_enqueued"] == 5  # 46 tokens: 5 full blocks
    # Closed: the hot cache keeps serving, nothing more reaches the stopped tier.
    q0 = p[:20] + [7]
    r = paged.begin(q0)
    r.end(q0 + run(model, q0[r.cached_tokens:], r.cache, n=1)[0])
    assert paged.cold_tier is None and paged.coordinator.stats()["cold_capture_errors"] == 0
    q = p[:4 * BS] + toks(6, 32)
    done = subprocess.run([sys.executable, "-c", _RESTORE_CHILD, str(cold), json.dumps(q),
                           json.dumps(p)],
                          check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    child = json.loads(done.stdout.strip().splitlines()[-1])
    assert child == {"restored": 32, "cached": 32, "same": True, "cold_hits": 4,
                     "corruptions": 0}

    # A corrupt object is a counted miss: the chain stops there and the rest is recomputed.
    from safetensors import safe_open
    third = np.asarray(q[2 * BS:3 * BS], "<u4").tobytes()
    objects = {}
    for f in (cold / "pagedkv-v1").rglob("*.safetensors"):
        with safe_open(str(f), "np") as obj:
            objects[obj.get_tensor("tokens").tobytes()] = f
    assert len(objects) == 5
    data = bytearray(objects[third].read_bytes())
    data[-40] ^= 0xFF  # inside the payload: the checksum no longer matches
    objects[third].write_bytes(bytes(data))
    with PagedPromptCache(model, block_size=BS, cold_dir=cold) as paged:
        r = paged.begin(q)
        assert (r.cached_tokens, r.restored_tokens) == (2 * BS, 2 * BS)
        got = run(model, q[r.cached_tokens:], r.cache)
        assert got == reused(model, p, 6, 2 * BS, q)
        if on_cpu():
            assert got == fresh(model, q)
        s = paged.stats()
        assert s["cold_corruptions"] == 1 and s["cold_hits"] == 2
        r.release()
    assert not objects[third].exists()  # pruned


# --- what the cache refuses, and the state it leaves -----------------------------------------

def test_end_with_the_wrong_tokens_changes_nothing():
    model = model_of()
    paged = PagedPromptCache(model, block_size=BS)
    p = toks(20, 40)
    r = paged.begin(p)
    out = run(model, p, r.cache)[0]
    before = paged.stats()
    for bad, match in (((p + out)[:-1], "25 ids but request .* holds 26"),
                       (p + out + [1], "27 ids")):
        with pytest.raises(InvalidArgument, match=match):
            r.end(bad)
        assert paged.stats() == before and r.state == "live"
    with pytest.raises(InvalidArgumentType):
        r.end([0.5] * 26)
    assert paged.stats() == before
    assert r.end(p + out) == 26
    with pytest.raises(RequestClosed, match="ended"):
        r.end(p + out)
    with pytest.raises(RequestClosed):
        r.fork()
    assert repr(r).startswith(f"PagedRequest(id={r.request_id}, state='ended'")


def test_bad_arguments_are_refused_before_anything_changes():
    model = model_of()
    with pytest.raises(InvalidArgument, match="block_size"):
        PagedPromptCache(model, block_size=12)
    with pytest.raises(InvalidArgument, match="q8"):
        PagedPromptCache(model, dtype="q8")
    paged = PagedPromptCache(model, block_size=BS)
    before = paged.stats()
    with pytest.raises(InvalidArgument, match="empty"):
        paged.begin([])
    with pytest.raises(InvalidArgument, match="must be 1-D"):
        paged.begin([[1, 2]])
    with pytest.raises(InvalidArgument, match="contains -1"):
        paged.begin([1, -1])
    with pytest.raises(InvalidArgumentType, match="cache_salt"):
        paged.begin([1, 2], cache_salt=1.5)
    with pytest.raises(InvalidArgument, match="layers"):
        paged.insert([1, 2], make_prompt_cache(model)[:1])
    # These raised builtin TypeError / IndexError, or (max_parked=1.5) were taken.
    with pytest.raises(InvalidArgumentType, match="cache must be a sequence, got NoneType"):
        paged.insert([1, 2], None)
    flat = make_prompt_cache(model)
    for c in flat:
        c.keys, c.values, c.offset = mx.zeros((2, 40, 16)), mx.zeros((2, 40, 16)), 40
    with pytest.raises(InvalidArgument, match=r"insert: layer 0 K/V have shapes \(2, 40, 16\) "
                                              r"and \(2, 40, 16\), expected arrays "
                                              r"\[1, 2, >= 40, 16\]"):
        paged.insert(toks(40, 1), flat)
    assert paged.stats() == before
    for bad, error, match in (("3", InvalidArgumentType, "max_parked must be an int, got str"),
                              (1.5, InvalidArgumentType, "max_parked must be an int, got float"),
                              (-1, InvalidArgument, "max_parked = -1 must be >= 0")):
        with pytest.raises(error, match=match):
            PagedPromptCache(model, max_parked=bad)
    # A negative trim grew the offset of the layer it was called on (KVCache.trim does too).
    r = paged.begin(toks(20, 2))
    run(model, toks(20, 2), r.cache, n=1)
    with pytest.raises(InvalidArgument, match="trim: n = -5 must be >= 0"):
        r.cache[0].trim(-5)
    with pytest.raises(InvalidArgumentType, match="trim: n must be an int, got bool"):
        r.cache[0].trim(True)
    assert [c.offset for c in r.cache] == [21, 21]
    r.release()
    assert "PagedPromptCache(model_type='qwen3', layers=2, kv_heads=2, head_dim=16" in repr(paged)


def test_tenants_with_different_salts_never_share_blocks():
    model = model_of()
    paged = PagedPromptCache(model, block_size=BS)
    p = toks(30, 41)
    for salt, cached in ((None, 0), ("tenant-a", 0), ("tenant-a", 24), ("tenant-b", 0),
                         (None, 24)):
        prompt = p + [int(salt is None)]
        r = paged.begin(prompt, cache_salt=salt)
        assert r.cached_tokens == cached, (salt, cached)
        out = run(model, prompt[cached:], r.cache, n=1)
        assert out == (fresh(model, prompt, n=1) if cached == 0 else
                       reused(model, prompt, 1, cached, prompt, n=1))
        r.end(prompt + out[0])


def test_the_layer_cache_speaks_mlx_lm_protocol(tmp_path):
    model = model_of()
    paged = PagedPromptCache(model, block_size=BS)
    p = toks(20, 42)
    r = paged.begin(p)
    ref = make_prompt_cache(model)
    layer = r.cache[0]
    assert not hasattr(layer, "bits")  # mlx-lm's quantized attention keys on it
    assert layer.empty() and layer.nbytes == 0 and layer.size() == 0 and layer.is_trimmable()
    run(model, p, r.cache, n=2)
    run(model, p, ref, n=2)
    assert layer.size() == ref[0].size() == 22 and not layer.empty()
    assert layer.nbytes == ref[0].nbytes
    # As mlx_lm.models.base.create_attention_mask calls it.
    for n, return_array, window_size in ((1, False, None), (5, False, None), (5, True, None),
                                         (5, False, 3)):
        kwargs = {"return_array": return_array, "window_size": window_size}
        ours, theirs = layer.make_mask(n, **kwargs), ref[0].make_mask(n, **kwargs)
        assert type(ours) is type(theirs)
        if isinstance(ours, mx.array):
            assert mx.array_equal(ours, theirs).item()
        else:
            assert ours == theirs
    k, _, offset = layer.state
    assert offset == 22 and k.shape == ref[0].state[0].shape
    with pytest.raises(RequestClosed, match="cold_dir"):
        layer.state = ref[0].state
    # mlx-lm's save_prompt_cache reads only ``state`` (evaluated after every prefill chunk,
    # so it cannot refuse): the file is written, and load_prompt_cache cannot rebuild it.
    save_prompt_cache(str(tmp_path / "saved.safetensors"), r.cache)
    with pytest.raises(KeyError, match="PagedKVLayerCache"):
        load_prompt_cache(str(tmp_path / "saved.safetensors"))
    # mlx-lm's kv_bits path would swap in a private QuantizedKVCache: refused, by name.
    with pytest.raises(InvalidArgument, match="kv_bits=4"):
        run(model, [3], r.cache, n=1, kv_bits=4, quantized_kv_start=0)
    assert "PagedKVLayerCache(layer=0, offset=" in repr(layer)
    r.release()


def test_dropped_requests_give_their_blocks_back():
    model = model_of()
    paged = PagedPromptCache(model, block_size=BS)
    p = toks(40, 43)
    r = paged.begin(p)
    r.end(p + run(model, p, r.cache)[0])  # parked: 46 tokens, 6 blocks
    held = paged.stats()["blocks_in_use"]
    r2 = paged.begin(p[:32] + toks(20, 44))
    assert paged.stats()["live_requests"] == 1
    del r2
    gc.collect()
    s = paged.stats()
    assert s["live_requests"] == 0 and s["released"] == 1 and s["blocks_in_use"] == held


def test_a_pool_short_of_blocks_collects_requests_dropped_in_a_reference_cycle():
    """A request and its layers reference each other, so a request dropped without end() or
    release() is freed by Python's cyclic garbage collector only, and holds its blocks until
    a full collection runs. Before refusing a reservation with PoolExhausted the cache runs
    one and releases what it collected: the prompt is served (it was refused while the
    dropped request's 5 blocks stayed held). With nothing to collect the refusal stands and
    changes nothing."""
    model = model_of()
    paged = PagedPromptCache(model, block_size=BS, max_blocks=8, initial_blocks=8)
    automatic = gc.isenabled()
    gc.disable()  # no collection but the cache's own
    try:
        dropped = paged.begin(toks(40, 46))  # 5 of the 8 blocks
        run(model, toks(40, 46), dropped.cache, n=2)
        del dropped
        assert paged.stats()["live_requests"] == 1
        assert paged.stats()["blocks_in_use"] == 5
        big = toks(60, 47)  # 8 blocks
        r = paged.begin(big)
        s = paged.stats()
        assert (r.cached_tokens, s["released"], s["live_requests"]) == (0, 1, 1)
        before = s
        with pytest.raises(PoolExhausted, match="1 more blocks needed for 8 tokens, "
                                                "0 free or evictable of 8"):
            paged.begin(toks(8, 48))
        assert paged.stats() == before
        r.release()
    finally:
        if automatic:
            gc.enable()


def test_parked_conversations_are_bounded_and_yield_to_pool_pressure():
    model = model_of()
    paged = PagedPromptCache(model, block_size=BS, initial_blocks=8, max_blocks=64,
                             max_parked=2)
    ends = []
    for i in range(3):
        p = toks(14, 50 + i)  # 2 blocks each once ended (14 + 1 fed token)
        r = paged.begin(p)
        out = run(model, p, r.cache, n=2)[0]
        r.end(p + out)
        ends.append(p + out)
    s = paged.stats()
    assert s["parked"] == 2 and s["parked_released"] == 1
    # A prompt needing every block of the pool: the parked tables are released for it
    # rather than the pool grown.
    big = toks(63, 60)
    r = paged.begin(big)
    s = paged.stats()
    assert r.cached_tokens == 0 and s["parked"] == 0
    assert s["grow_events"] == 0 and s["pool_blocks"] == 8
    assert run(model, big, r.cache, n=1) == fresh(model, big, n=1)
    r.release()


def test_a_refused_begin_leaves_the_conversation_it_would_continue_parked():
    """begin() of a prompt that extends a parked conversation takes it out of the park to
    continue it. Refused, the conversation goes back where it was, table intact, and its
    next turn still continues it: it was released by the failed reservation, and a prompt
    longer than the pool (CapacityExceeded) released every other parked one too."""
    model = model_of()
    paged = PagedPromptCache(model, block_size=BS, max_blocks=16, initial_blocks=16)
    ends = []
    for seed in (63, 64):  # 24 tokens each: 3 full blocks, parked
        p = toks(20, seed)
        r = paged.begin(p)
        ends.append(p + run(model, p, r.cache, n=4)[0])
        r.end(ends[-1])
    before = paged.stats()
    assert (before["parked"], before["blocks_in_use"]) == (2, 6)
    with pytest.raises(CapacityExceeded, match="requested 144 tokens, paged cache capacity "
                                               "is 128 tokens"):
        paged.begin(ends[0] + toks(120, 65))
    assert paged.stats() == before
    # Blocks held by a live request: the oldest parked conversation is released for room
    # (the pressure rule), the one being continued is not.
    live = paged.begin(toks(72, 66))  # 9 blocks: 1 free
    with pytest.raises(PoolExhausted, match="5 more blocks needed for 64 tokens, 4 free or "
                                            "evictable"):
        paged.begin(ends[1] + toks(40, 67))  # 8 blocks: 5 more
    s = paged.stats()
    assert (s["parked"], s["parked_released"], s["released"]) == (1, 1, 0)
    live.release()
    r = paged.begin(ends[1] + [5])
    assert r.cached_tokens == paged.stats()["continued_tokens"] == 24
    assert run(model, [5], r.cache, n=2) == reused(model, ends[1][:20], 4, 24,
                                                   ends[1] + [5], n=2)
    r.release()


def test_a_pool_dtype_other_than_the_models_casts_at_the_pool_boundary():
    model = model_of()  # float32 K/V
    paged = PagedPromptCache(model, block_size=BS, dtype="float16")
    assert paged.geometry.dtype == "float16" and paged.kv_dtype == "float32"
    p = toks(20, 45)
    r = paged.begin(p)
    ref = make_prompt_cache(model)
    out = run(model, p, r.cache, n=1)
    assert out == run(model, p, ref, n=1)
    r.end(p + out[0])
    r2 = paged.begin(p[:16] + [7])
    assert r2.cached_tokens == 16 and r2.cache[0].keys.dtype == mx.float32
    want = ref[0].keys[..., :16, :].astype(mx.float16).astype(mx.float32)
    assert mx.array_equal(r2.cache[0].keys[..., :16, :], want).item()
    r2.release()


# --- the MLX pool path ------------------------------------------------------------------------

class CountingMlx:
    """``mlx.core`` that counts ``eval`` and ``async_eval`` calls (a pool storage's ``_mx``)."""

    def __init__(self):
        self.evals = self.async_evals = 0

    def __getattr__(self, name):
        return getattr(mx, name)

    def eval(self, *a):
        self.evals += 1
        return mx.eval(*a)

    def async_eval(self, *a):
        self.async_evals += 1
        return mx.async_eval(*a)


def test_mlx_pool_token_writes_and_gathers_do_not_evaluate():
    from pagedkv.pool import LayerKVPool, PoolGeometry
    from pagedkv.pool.mlx_storage import MAX_PENDING_WRITES

    pool = LayerKVPool(PoolGeometry(2, 2, 16, BS, "float32"), 8, backend="mlx")
    counting = CountingMlx()
    pool._storage._mx = counting
    k = mx.ones((1, 2, 16))
    for step in range(MAX_PENDING_WRITES + 1):
        pool.write_tokens(step % 2, [step % 64], k * step, -k * step)
        pool.gather(step % 2, [0, 1], 9)
    assert counting.evals == 0 and counting.async_evals == 1  # one bounded flush
    pool.flush()
    assert counting.async_evals == 2 and counting.evals == 0
    got, _ = pool.gather(0, list(range(8)), 64)
    assert got[62, 0, 0].item() == 62.0 and got[63, 0, 0].item() == 0.0


def test_an_mlx_without_shareable_streams_keeps_the_pool_eager(monkeypatch):
    from pagedkv.pool import LayerKVPool, PoolGeometry, mlx_storage

    monkeypatch.setattr(mlx_storage, "pool_stream", lambda mx: None)
    pool = LayerKVPool(PoolGeometry(1, 2, 16, BS, "float32"), 2, backend="mlx")
    counting = CountingMlx()
    monkeypatch.setattr(pool._storage, "_mx", counting)
    pool.write_tokens(0, [3], mx.ones((1, 2, 16)), mx.ones((1, 2, 16)))
    k, _ = pool.gather(0, [0], 4)
    assert counting.evals == 2 and k[3, 0, 0].item() == 1.0
    assert repr(pool._storage).endswith("lazy=False)")


def test_import_pagedkv_without_mlx_lm():
    code = ("import sys; sys.modules['mlx_lm'] = None\n"
            "import pagedkv, pagedkv.integrations\n"
            "try:\n    import pagedkv.integrations.mlx_lm\n"
            "except ImportError as e:\n    print('ImportError:', e)\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ImportError: pagedkv.integrations.mlx_lm needs mlx-lm >= 0.32" in done.stdout
    assert "pip install 'pagedkv[mlx-lm]'" in done.stdout


# --- the server's prompt-cache object and the command line ------------------------------------

def test_server_prompt_cache_answers_mlx_lm_servers_calls(caplog):
    from types import SimpleNamespace

    from pagedkv.integrations.mlx_lm.server import PagedServerPromptCache

    model = model_of()
    cache = PagedServerPromptCache(SimpleNamespace(model=model), block_size=BS)
    assert len(cache) == 0 and cache.nbytes == 0 and cache.stats_by_type() == {}
    key = ("/no/such/dir", None, None)
    system = toks(24, 70)
    for i in range(3):
        prompt = system + toks(4, 71 + i)
        layers, rest = cache.fetch_nearest_cache(key, prompt)
        assert len(rest) == len(prompt) - (0 if i == 0 else 24)
        out = run(model, rest, layers)[0]
        cache.insert_cache(key, prompt + out, layers)
    assert len(cache) == 3 and cache.paged.stats()["blocks_shared"] == 3
    assert cache.nbytes == cache.paged.stats()["bytes_in_use"] > 0
    assert cache.stats_by_type() == {"paged": {"n_sequences": 3, "n_bytes": cache.nbytes}}
    cache.trim_to(n_sequences=1)
    # 34 tokens each: 3 shared blocks + 1 own block per conversation stay cached.
    assert len(cache) == 1 and cache.paged.stats()["blocks_cached"] == 3 + 3
    # A publication that does not match its cache is logged and counted, never raised.
    layers, rest = cache.fetch_nearest_cache(key, system + [9])
    assert layers[0].offset == 24 and rest == [9]
    cache.insert_cache(key, system, layers)  # exactly what the layers hold: fine
    assert cache.publish_errors == 0
    before = cache.paged.stats()
    layers, rest = cache.fetch_nearest_cache(key, system + [9, 9])
    cache.insert_cache(key, system + [9, 9, 9], layers)
    assert cache.publish_errors == 1 and "could not publish 27 tokens" in caplog.text
    assert cache.paged.stats()["published_tokens"] == before["published_tokens"]
    cache.close()
    assert cache.paged is None


def test_server_prompt_cache_leaves_what_the_pool_cannot_serve_to_mlx_lm(caplog):
    """A prompt longer than the pool (CapacityExceeded) and one that the requests in flight
    leave too few blocks for (PoolExhausted) are answered ``(None, tokens)``, as
    ``LRUPromptCache`` answers a miss: mlx-lm then computes them with its own cache. Raised,
    the error ended mlx-lm's generation thread and every later request got 404. Logged and
    counted; the paged cache is unchanged."""
    from types import SimpleNamespace

    from pagedkv.integrations.mlx_lm.server import PagedServerPromptCache

    model = model_of()
    cache = PagedServerPromptCache(SimpleNamespace(model=model), block_size=BS, max_blocks=4)
    key = ("/no/such/dir", None, None)
    in_flight = toks(20, 80)
    layers, rest = cache.fetch_nearest_cache(key, in_flight)  # 3 of the 4 blocks, held
    assert rest == in_flight
    before = cache.paged.stats()
    too_long, too_many = toks(40, 81), toks(16, 82)  # 5 blocks; 2 blocks with 1 free
    assert cache.fetch_nearest_cache(key, too_long) == (None, too_long)
    assert cache.fetch_nearest_cache(key, too_many) == (None, too_many)
    assert cache.fetch_errors == 2 and cache.paged.stats() == before
    assert "cannot serve a 40-token prompt from the paged cache (context_length_exceeded: " \
        "paged cache could not reserve: requested 40 tokens, paged cache capacity is 32 " \
        "tokens (4 blocks of 8))" in caplog.text
    assert "cannot serve a 16-token prompt" in caplog.text
    # The request in flight is untouched: it ends and publishes as usual.
    out = run(model, in_flight, layers)[0]
    cache.insert_cache(key, in_flight + out, layers)
    assert cache.publish_errors == 0 and len(cache) == 1
    cache.close()


def test_server_prompt_cache_never_restores_base_model_kv_into_a_lora_adapter(tmp_path,
                                                                              monkeypatch):
    """mlx-lm's server keys a model by (model path, adapter path, draft path). The cold tier's
    file fingerprint reads the model directory only, so with an adapter the fingerprint
    hashes the loaded parameters (LoRA weights included): K/V the base model published are
    not restored into the adapted model (they were: 32 tokens of another model's K/V), and
    the base model, keyed by its files, still restores them."""
    from types import SimpleNamespace

    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from pagedkv.integrations.mlx_lm.random_models import save_random_model
    from pagedkv.integrations.mlx_lm.server import PagedServerPromptCache

    monkeypatch.setenv("PAGEDKV_PERSIST_PAGED_CACHE", "1")
    model_dir, adapter_dir = str(tmp_path / "model"), tmp_path / "adapter"
    save_random_model(model_dir, "qwen3")
    lora = {"rank": 4, "scale": 10.0, "dropout": 0.0}
    with_lora = load(model_dir)[0]
    linear_to_lora_layers(with_lora, 2, lora)
    adapter_dir.mkdir()
    mx.save_safetensors(str(adapter_dir / "adapters.safetensors"), {
        k: mx.random.normal(v.shape, key=mx.random.key(i)) * 0.5
        for i, (k, v) in enumerate(tree_flatten(with_lora.parameters()))
        if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")})
    (adapter_dir / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora}))
    base, adapted = load(model_dir)[0], load(model_dir, adapter_path=str(adapter_dir))[0]

    provider = SimpleNamespace(model=base, model_key=(model_dir, None, None))
    cache = PagedServerPromptCache(provider, block_size=BS, cold_dir=tmp_path / "cold")
    prompt = toks(40, 90)
    layers, rest = cache.fetch_nearest_cache(provider.model_key, prompt)
    cache.insert_cache(provider.model_key, prompt + run(base, rest, layers)[0], layers)
    question = prompt + [7, 8]
    for model, adapter, restored in ((adapted, str(adapter_dir), 0), (base, None, 40)):
        provider.model, provider.model_key = model, (model_dir, adapter, None)
        layers, rest = cache.fetch_nearest_cache(provider.model_key, question)  # a new pool
        assert len(question) - len(rest) == layers[0].request.restored_tokens == restored
        assert cache.paged.stats()["cold_hits"] == restored // BS
        layers[0].request.release()
    cache.close()


def test_serve_refuses_what_it_cannot_page_and_other_commands_refuse_extra_options(capsys):
    from pagedkv.cli import main

    assert main(["serve", "--model", "/nonexistent", "--draft-model", "x"]) == 1
    assert "--draft-model: pagedkv serve does not page the draft model" in \
        capsys.readouterr().err
    assert main(["serve", "--model", "/nonexistent", "--kv-bits=4"]) == 1
    assert "--kv-bits: pagedkv serve does not page quantized KV" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["demo", "--port", "1"])
    assert e.value.code == 2 and "unrecognized arguments: --port 1" in capsys.readouterr().err
