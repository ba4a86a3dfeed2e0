"""The cuda backend's Triton kernels (backends/cuda/triton_decode.py, triton_moe.py, triton_glm.py, triton_mhc.py,
triton_router.py, triton_gemv.py and the KDA kernels in ops.py) against the references, on
the CPU through Triton's interpreter (TRITON_INTERPRET=1): small shapes, so that it runs in seconds here.
On a machine with a GPU they are checked natively instead, by `flagdeploy ops check --chip cuda`
(tests/test_cuda.py). triton comes with the test extra; a CUDA build of torch brings its own."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from flagdeploy.ops import reference as ref

# Triton decides at import time whether its own @jit helpers (tl.sum, ...) are interpreted, so the
# interpreter cannot be switched on inside a process that imported triton already: in a normal run this
# module runs itself again in a subprocess with TRITON_INTERPRET=1, and only there are the kernels tested.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRETED:

    @pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the kernels natively (tests/test_cuda.py)")
    def test_the_kernels_under_the_triton_interpreter():
        env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                           env=env, capture_output=True, text=True, timeout=300, check=False)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        assert " passed" in r.stdout


TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
       torch.float16: {"atol": 5e-3, "rtol": 5e-3}}


@pytest.fixture(scope="module")
def td():
    if not INTERPRETED:
        pytest.skip("runs in the interpreter subprocess")
    return importlib.import_module("backends.cuda.triton_decode")


def _r(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _close(got, want, dtype):
    torch.testing.assert_close(got.double(), want.double(), **TOL[dtype])


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_and_add_rms_norm(td, dtype):
    g = torch.Generator().manual_seed(0)
    x, res, w = _r(g, 3, 96, dtype=dtype), _r(g, 3, 96, dtype=dtype), _r(g, 96, dtype=dtype)
    _close(td.rms_norm(x, w, 1e-5), ref.rms_norm(x.double(), w.double(), 1e-5), dtype)
    out, h = td.add_rms_norm(x, res, w, 1e-5)
    want_out, want_h = ref.add_rms_norm(x.double(), res.double(), w.double(), 1e-5)
    _close(out, want_out, dtype)
    _close(h, want_h, dtype)
    assert out.dtype == h.dtype == dtype  # (no bit-for-bit check: the interpreter's bf16 casts truncate)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_on_strided_views_of_a_fused_qkv(td, dtype):
    g = torch.Generator().manual_seed(1)
    t, h, kh, d = 3, 4, 2, 16
    qkv = _r(g, t, (h + 2 * kh) * d, dtype=dtype)
    q, k, _ = qkv.split((h * d, kh * d, kh * d), dim=-1)
    q, k = q.view(t, h, d), k.view(t, kh, d)
    cos, sin = ref.rope_tables(d, 32, 10000.0)
    pos = torch.tensor([0, 7, 31])
    before = qkv.clone()
    gq, gk = td.rope(q, k, cos[pos], sin[pos])
    wq, wk = ref.rope(q.double(), k.double(), cos[pos].double(), sin[pos].double())
    _close(gq, wq, dtype)
    _close(gk, wk, dtype)
    assert torch.equal(qkv, before)  # out of place, as the reference


@pytest.mark.parametrize("limit", [None, 2.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu(td, dtype, limit):
    g = torch.Generator().manual_seed(2)
    x = _r(g, 3, 2 * 40, dtype=dtype, scale=3.0)
    _close(td.swiglu(x, limit), ref.swiglu(x.double(), limit), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_cache(td, dtype):
    g = torch.Generator().manual_seed(3)
    t, kh, d = 4, 2, 8
    kv = _r(g, t, 3 * kh * d, dtype=dtype)
    k, v = kv[:, kh * d: 2 * kh * d].view(t, kh, d), kv[:, 2 * kh * d:].view(t, kh, d)  # strided, as in the model
    slots = torch.tensor([3, 0, 11, 9])
    kc, vc = torch.zeros(3, 4, kh, d, dtype=dtype), torch.zeros(3, 4, kh, d, dtype=dtype)
    wk, wv = kc.clone(), vc.clone()
    td.write_kv_cache(k, v, kc, vc, slots)
    ref.write_kv_cache(k, v, wk, wv, slots)
    assert torch.equal(kc, wk) and torch.equal(vc, wv)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_write_kv_is_rope_then_the_cache_write(td, dtype):
    """The fused kernel on strided views of a fused qkv: rotated q and k as `rope` gives them, the rotated
    k and v at their slots as `write_kv_cache` stores them; a negative slot (padding) writes nothing."""
    g = torch.Generator().manual_seed(5)
    t, h, kh, d = 4, 4, 2, 16
    q, k, v = _r(g, t, (h + 2 * kh) * d, dtype=dtype).split((h * d, kh * d, kh * d), dim=-1)
    q, k, v = q.view(t, h, d), k.view(t, kh, d), v.view(t, kh, d)
    cos, sin = ref.rope_tables(d, 32, 10000.0)
    pos, slots = torch.tensor([0, 7, 31, 2]), torch.tensor([3, 0, -1, 9])
    kc, vc = torch.zeros(3, 4, kh, d, dtype=dtype), torch.zeros(3, 4, kh, d, dtype=dtype)
    wkc, wvc = kc.clone(), vc.clone()
    gq, gk = td.rope_write_kv(q, k, v, cos[pos], sin[pos], kc, vc, slots)
    wq, wk = ref.rope(q, k, cos[pos], sin[pos])
    keep = slots >= 0
    ref.write_kv_cache(wk[keep], v[keep], wkc, wvc, slots[keep])
    _close(gq, wq, dtype)
    _close(gk, wk, dtype)
    _close(kc, wkc, dtype)
    assert torch.equal(vc, wvc)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv_update_moves_the_window_in_place(dtype):
    """KDA's short conv for one decode token per sequence (backends/cuda/ops.py): the output and the state
    rows it shifts in place equal the reference's; rows of other sequences stay as they were."""
    if not INTERPRETED:
        pytest.skip("runs in the interpreter subprocess")
    from flagdeploy.ops.glm import causal_conv1d_update

    cops = importlib.import_module("backends.cuda.ops")
    g = torch.Generator().manual_seed(6)
    x, w = _r(g, 3, 40, dtype=dtype), _r(g, 40, 4, dtype=torch.float32, scale=0.5)
    pool = _r(g, 5, 3, 40, dtype=dtype)
    slots = torch.tensor([4, 0, 2])
    want_pool = pool.clone()
    want = causal_conv1d_update(x, w, want_pool, slots)
    got = cops.causal_conv1d_update(x, w, pool, slots)
    _close(got, want, dtype)
    _close(pool, want_pool, dtype)
    assert torch.equal(pool[[1, 3]], want_pool[[1, 3]])


@pytest.mark.parametrize("split", [True, False], ids=["split", "one-program"])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_paged_attention_decode(td, dtype, table_dtype, split, monkeypatch):
    """Block size 4 (keys gathered across blocks within one BLOCK_N step), GQA group of 4, lengths that
    end mid-block, one past BLOCK_N (two steps of the loop, or two splits, the others' second empty), a
    single key."""
    monkeypatch.setattr(td, "_SPLIT_MIN_KEYS", 64)  # small shapes: split at 64 keys (256 on the GPU)
    if not split:
        monkeypatch.setattr(td, "_SMS", 1)
    assert td._decode_splits(3, 2, 80) == (2 if split else 1)
    g = torch.Generator().manual_seed(4)
    nb, bs, kh, h, d = 24, 4, 2, 8, 16
    perm = torch.randperm(nb, generator=g)
    tables = torch.stack([perm[:20], perm[4:24], perm[2:22]]).to(table_dtype)
    lens = torch.tensor([5, 66, 1], dtype=torch.int32)
    q = _r(g, 3, h, d, dtype=dtype)
    kc, vc = _r(g, nb, bs, kh, d, dtype=dtype), _r(g, nb, bs, kh, d, dtype=dtype)
    got = td.paged_attention_decode(q, kc, vc, tables, lens, d ** -0.5)
    want = ref.paged_attention_decode(q.double(), kc.double(), vc.double(), tables, lens, d ** -0.5)
    _close(got, want, dtype)


def test_paged_attention_decode_many_splits_long_blocks(td, monkeypatch):
    """One sequence over 4 splits of 64 keys, block size 16, the last split partly masked."""
    monkeypatch.setattr(td, "_SPLIT_MIN_KEYS", 64)
    g = torch.Generator().manual_seed(6)
    nb, bs, kh, h, d = 20, 16, 2, 4, 32
    tables = torch.randperm(nb, generator=g)[:16][None]
    lens = torch.tensor([250], dtype=torch.int32)
    assert td._decode_splits(1, kh, 16 * bs) == 4
    q = _r(g, 1, h, d, dtype=torch.float16)
    kc, vc = _r(g, nb, bs, kh, d, dtype=torch.float16), _r(g, nb, bs, kh, d, dtype=torch.float16)
    got = td.paged_attention_decode(q, kc, vc, tables, lens, d ** -0.5)
    want = ref.paged_attention_decode(q.double(), kc.double(), vc.double(), tables, lens, d ** -0.5)
    _close(got, want, torch.float16)


def test_decode_split_counts(td):
    """Short contexts run one program per (sequence, kv head); long ones with few sequences are split."""
    assert td._decode_splits(1, 8, 256) == 1
    assert td._decode_splits(1, 8, 1024) == 4
    assert td._decode_splits(1, 8, 16384) == 33  # ~2 programs per SM
    assert td._decode_splits(64, 8, 16384) == 1  # enough programs already


def test_unhandled_inputs_fall_back(td):
    """float32 decode attention and odd head sizes go to the fused implementations, same answers."""
    g = torch.Generator().manual_seed(5)
    q, kc, vc = _r(g, 1, 2, 12, dtype=torch.float32), _r(g, 2, 4, 1, 12, dtype=torch.float32), _r(g, 2, 4, 1, 12, dtype=torch.float32)
    tables, lens = torch.tensor([[1, 0]]), torch.tensor([6], dtype=torch.int32)
    got = td.paged_attention_decode(q, kc, vc, tables, lens, 0.3)
    _close(got, ref.paged_attention_decode(q.double(), kc.double(), vc.double(), tables, lens, 0.3), torch.float32)
    x = _r(g, 2, 8, dtype=torch.float64)
    w = _r(g, 8, dtype=torch.float64)
    torch.testing.assert_close(td.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("limit", [None, 1.5], ids=["no-limit", "limit"])
def test_fp8_expert_kernels_match_the_reference(dtype, limit):
    """The FP8 routed-expert kernels (backends/cuda/triton_moe.py) quantise activations as the reference's
    FP8 linear does, so they agree with it, not just with the dequantized bank: 3 tokens, top 2 of 5
    experts, scale blocks of (16, 16) and (16, 32), an input width that ends mid-block."""
    if not INTERPRETED:
        pytest.skip("runs in the interpreter subprocess")
    from flagdeploy.ops.glm import moe_experts
    from flagdeploy.ops.weights import Fp8BlockWeight

    tm = importlib.import_module("backends.cuda.triton_moe")
    g = torch.Generator().manual_seed(4)
    t, e, hidden, inter, k = 3, 5, 40, 32, 2
    x = _r(g, t, hidden, dtype=dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    routing = torch.zeros(t, e, dtype=torch.float64).scatter_(1, ids, torch.rand(t, k, generator=g, dtype=torch.float64))
    gate_up = Fp8BlockWeight.quantize(torch.randn(e, 2 * inter, hidden, generator=g) * 0.3, (16, 16))
    down = Fp8BlockWeight.quantize(torch.randn(e, hidden, inter, generator=g) * 0.3, (16, 32))
    assert tm.supports(x, gate_up, down, k)
    got = tm.moe_fp8_experts(x, routing.to(dtype), gate_up, down, limit, k)
    want = moe_experts(x.double(), routing, gate_up, down, limit)
    _close(got, want, torch.bfloat16)  # the reference's FP8 linears return 16-bit values whatever x's dtype


@pytest.mark.parametrize("launch", [((16, 4, 2, 1), (16, 4, 2, 1)), ((64, 4, 2, 2), (32, 4, 2, 3))],
                         ids=["unsplit", "split"])
def test_fp8_expert_kernels_share_an_expert_between_tokens(launch, monkeypatch):
    """20 tokens that all pick expert 3 and one other of 5: 20 pairs of one expert, more than a program's
    BLOCK_M, so two programs share it, and one program for the several pairs of each other expert; with
    the input split over programs (gate_up's raw sums added up by the down kernel, down's by the caller;
    down's third split is empty) or not."""
    if not INTERPRETED:
        pytest.skip("runs in the interpreter subprocess")
    from flagdeploy.ops.glm import moe_experts
    from flagdeploy.ops.weights import Fp8BlockWeight

    tm = importlib.import_module("backends.cuda.triton_moe")
    monkeypatch.setattr(tm, "FORCED", {"gate_up": launch[0], "down": launch[1]})
    g = torch.Generator().manual_seed(6)
    t, e, hidden, inter, k = 20, 5, 40, 32, 2
    x = _r(g, t, hidden, dtype=torch.bfloat16)
    other = torch.tensor([0, 1, 2, 4])[torch.randint(0, 4, (t,), generator=g)]
    ids = torch.stack([torch.full((t,), 3), other], 1)
    routing = torch.zeros(t, e, dtype=torch.float64).scatter_(1, ids, torch.rand(t, k, generator=g, dtype=torch.float64))
    routing[0, other[0]] = 0.0  # a token with one expert only, and one with none: picks of weight zero
    routing[1] = 0.0
    gate_up = Fp8BlockWeight.quantize(torch.randn(e, 2 * inter, hidden, generator=g) * 0.3, (16, 16))
    down = Fp8BlockWeight.quantize(torch.randn(e, hidden, inter, generator=g) * 0.3, (16, 32))
    assert t > tm.BLOCK_M
    got = tm.moe_fp8_experts(x, routing.to(torch.bfloat16), gate_up, down, 1.5, k)
    want = moe_experts(x.double(), routing.to(torch.bfloat16).double(), gate_up, down, 1.5)
    _close(got, want, torch.bfloat16)


def test_fp8_expert_kernels_pick_the_largest_routing_weights():
    """The picks are topk of |routing| (its weights signed as given); a token with fewer nonzeros than
    top_k repeats its first pick with weight zero (no other expert's weights read for it), one with none
    picks expert 0."""
    if not INTERPRETED:
        pytest.skip("runs in the interpreter subprocess")
    tm = importlib.import_module("backends.cuda.triton_moe")
    routing = torch.tensor([[0.0, -0.5, 0.25, 0.0, 0.75, 0.125, 0.0],
                            [0.0, 0.0, 0.0, -0.5, 0.0, 0.0, 0.0],
                            [0.0] * 7], dtype=torch.bfloat16)
    x = torch.ones(3, 32)
    _, _, ids, wts = tm._quantise(x, 3, 32, 16, 1, False, None, routing, 3)
    assert ids.view(3, 3).tolist() == [[4, 1, 2], [3, 3, 3], [0, 0, 0]]
    assert wts.view(3, 3).tolist() == [[0.75, -0.5, 0.25], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]


# ---- GLM-5.3-Flash's DSA decode kernels (backends/cuda/triton_glm.py) --------------------------------------


@pytest.fixture(scope="module")
def tg():
    if not INTERPRETED:
        pytest.skip("runs in the interpreter subprocess")
    return importlib.import_module("backends.cuda.triton_glm")


def _glm_spec(name):
    from flagdeploy.ops.registry import OPS  # (importing flagdeploy.ops declares the GLM ops)

    return OPS[name]


def _glm_reference(name):
    return _glm_spec(name).reference


@pytest.mark.parametrize("split", [True, False], ids=["split", "one-program"])
@pytest.mark.parametrize("heads,rank", [(4, 32), (20, 8)], ids=["h4-r32", "h20-r8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_latent_attention_decode(tg, dtype, heads, rank, split, monkeypatch):
    """48 latent rows in tiles of 16, over three splits or one program: a sequence selecting only within
    its first 20 rows (its last tile is skipped, its last split empty), one selecting all over, one
    selecting nothing (zeros), one selecting a single row of the last split. 20 heads take two head
    blocks, one partly masked; a rank of 8 is padded to the dot's 16."""
    monkeypatch.setattr(tg, "_LATENT_SMALL", (16, 16, 4))  # small shapes: tiles of 16 rows
    monkeypatch.setattr(tg, "_SPLIT_ROWS", 16 if split else 1 << 30)
    b, s = 4, 48
    assert tg._latent_launch(b, heads, s) == (16, 16, 4, 16 if split else 48)
    g = torch.Generator().manual_seed(7)
    q, lat = _r(g, b, heads, rank, dtype=dtype), _r(g, b, s, rank, dtype=dtype)
    mask = torch.rand(b, s, generator=g) < 0.5
    mask[0, 20:] = False
    mask[1, [0, 40]] = True
    mask[2] = False
    mask[3] = False
    mask[3, 40] = True
    got = tg.latent_attention_decode(q, lat, mask.to(dtype), 0.3)
    want = _glm_reference("latent_attention_decode")(q.double(), lat.double(), mask.double(), 0.3)
    _close(got, want, dtype)
    assert got.dtype == dtype and not got[2].any()


def _indexer_case(dtype):
    """4 sequences in rows of 22 (5 complete pools of 4): lengths 22, 13 (a tail of 1), 3 (shorter than a
    pool) and 16 (a pool boundary). Sequence 1's padding is NaN: it must never be read into a result."""
    g = torch.Generator().manual_seed(8)
    b, s, hi, d, p = 4, 22, 4, 16, 4
    q, w = _r(g, b, hi, d, dtype=dtype), _r(g, b, hi, dtype=dtype)
    keys, gate, ape = _r(g, b, s, d, dtype=dtype), _r(g, b, s, d, dtype=dtype), _r(g, p, d, dtype=dtype)
    lengths = torch.tensor([22, 13, 3, 16])
    keys[1, 13:] = gate[1, 13:] = float("nan")
    return q, w, keys, gate, ape, lengths


# the interpreter's numpy warns about the NaN padding in the (never visible) pools it scores
_NAN_PADDING_OK = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@_NAN_PADDING_OK
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pool_scores_match_float64_and_are_well_separated(tg, dtype):
    """The scoring kernel against the reference's maths in float64 (-inf where a pool ends after the
    query); the two best visible pools are well clear of the third, so the selection test below is exact."""
    q, w, keys, gate, ape, lengths = _indexer_case(dtype)
    p, (b, s, d), hi = ape.shape[0], keys.shape, q.shape[1]
    n = s // p
    logits = gate[:, : n * p].double().view(b, n, p, d) + ape.double()
    pool_keys = (logits.softmax(2) * keys[:, : n * p].double().view(b, n, p, d)).sum(2)
    per_head = torch.relu(torch.einsum("bhd,bpd->bhp", q.double(), pool_keys) * d**-0.5)
    want = torch.einsum("bh,bhp->bp", w.double() * hi**-0.5, per_head)
    visible = (torch.arange(n) + 1) * p <= lengths[:, None]
    want = want.masked_fill(~visible, float("-inf"))
    got = tg._pool_scores(q, w, keys, gate, ape, lengths)
    _close(got, want, torch.float32)  # float32 maths whatever the input dtype
    for row in want:
        best = row[row.isfinite()].sort(descending=True).values
        if len(best) > 2:
            assert best[1] - best[2] > 1e-3


@_NAN_PADDING_OK
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "no-tail"])
@pytest.mark.parametrize("index_topk", [8, 32, 2], ids=["top2-pools", "all-fit", "none-fit"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dsa_indexer_topk_decode(tg, dtype, index_topk, tail):
    """The 0/1 mask equals the reference's exactly: the top 2 pools by rank, every visible pool when the
    budget holds them all (no scoring), none when it holds less than a pool; with or without the tail."""
    args = _indexer_case(dtype)
    got = tg.dsa_indexer_topk_decode(*args, index_topk, tail)
    want = _glm_reference("dsa_indexer_topk_decode")(*args, index_topk, tail)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want)


@_NAN_PADDING_OK
@pytest.mark.parametrize("index_topk", [8, 12], ids=["top2-pools", "top3-pools"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dsa_indexer_topk_decode_at_ties(tg, dtype, index_topk):
    """Exact ties at the top-k cut (the op check's inputs, flagdeploy/ops/glm.py `_tied_pools`): the kernel
    keeps the lower pool index, as the reference does, and the same pools when the rows are padded wider
    (NaN padding; 600 more rows are 155 pools, ranked in two blocks of competitors)."""
    (q, w, keys, gate, ape, lengths, _, tail), _ = _glm_spec("dsa_indexer_topk_decode").make_inputs(
        dtype, "cpu", torch.Generator().manual_seed(0))
    want = _glm_reference("dsa_indexer_topk_decode")(q, w, keys, gate, ape, lengths, index_topk, tail)
    assert torch.equal(tg.dsa_indexer_topk_decode(q, w, keys, gate, ape, lengths, index_topk, tail), want)
    s = keys.shape[1]
    for extra in (3, 600):
        pad = lambda x: torch.cat([x, torch.full((x.shape[0], extra, x.shape[2]), float("nan"), dtype=x.dtype)], 1)  # noqa: E731
        got = tg.dsa_indexer_topk_decode(q, w, pad(keys), pad(gate), ape, lengths, index_topk, tail)
        assert torch.equal(got[:, :s], want) and not got[:, s:].any()


def test_glm_decode_kernels_fall_back_on_unhandled_inputs(tg):
    """float64 and a latent rank that is not a power of two run the references."""
    g = torch.Generator().manual_seed(9)
    q, lat, mask = _r(g, 2, 3, 12, dtype=torch.float32), _r(g, 2, 5, 12, dtype=torch.float32), torch.ones(2, 5)
    want = _glm_reference("latent_attention_decode")(q, lat, mask, 0.3)
    assert torch.equal(tg.latent_attention_decode(q, lat, mask, 0.3), want)
    args = tuple(x.double() if x.is_floating_point() else x for x in _indexer_case(torch.float32))
    want = _glm_reference("dsa_indexer_topk_decode")(*args, 8, True)
    assert torch.equal(tg.dsa_indexer_topk_decode(*args, 8, True), want)


# ---- GLM-5.3-Flash's hyper-connections and router (backends/cuda/triton_mhc.py, triton_router.py) ----------


@pytest.fixture(scope="module")
def tm():
    if not INTERPRETED:
        pytest.skip("runs in the interpreter subprocess")
    return importlib.import_module("backends.cuda.triton_mhc")


def _hc_case(dtype, t=3, n=3, d=40):
    g = torch.Generator().manual_seed(11)
    return (_r(g, t, n, d, dtype=dtype), _r(g, (2 + n) * n, n * d, dtype=dtype, scale=0.1),
            _r(g, (2 + n) * n, dtype=torch.float32, scale=0.3), 1.0 + _r(g, 3, dtype=torch.float32, scale=0.2))


@pytest.mark.parametrize("split", [True, False], ids=["split-projection", "matmul-projection"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hc_pre(tm, dtype, split, monkeypatch):
    """3 streams (not a power of two) of 40 channels: the projection over 4 blocks of 32 input channels, the
    last one partial, or as one matmul (prefill); the collapse in blocks of 16 (the last partial). Against
    the reference in float64; outputs in the streams' dtype."""
    monkeypatch.setattr(tm, "_BLOCK_K", 32)
    monkeypatch.setattr(tm, "_BLOCK_D", 16)
    monkeypatch.setattr(tm, "_SPLIT_TOKENS", 64 if split else 0)
    streams, fn, base, scale = _hc_case(dtype)
    got = tm.hc_pre(streams, fn, base, scale, 1e-5, 1e-6, 7)
    want = _glm_reference("hc_pre")(streams.double(), fn.double(), base.double(), scale.double(), 1e-5, 1e-6, 7)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        _close(a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hc_post(tm, dtype, monkeypatch):
    monkeypatch.setattr(tm, "_BLOCK_D", 32)  # blocks of 16 channels: three, the last partial
    g = torch.Generator().manual_seed(12)
    h, streams, post = _r(g, 3, 40, dtype=dtype), _r(g, 3, 3, 40, dtype=dtype), _r(g, 3, 3, dtype=dtype)
    comb = torch.rand(3, 3, 3, generator=g).to(dtype)
    got = tm.hc_post(h, streams, post, comb)
    want = _glm_reference("hc_post")(h.double(), streams.double(), post.double(), comb.double())
    assert got.dtype == dtype
    _close(got, want, dtype)


def test_mhc_kernels_fall_back_on_unhandled_inputs(tm):
    streams, fn, base, scale = (x.double() for x in _hc_case(torch.float32))
    want = _glm_reference("hc_pre")(streams, fn, base, scale, 1e-5, 1e-6, 7)
    for a, b in zip(tm.hc_pre(streams, fn, base, scale, 1e-5, 1e-6, 7), want):
        assert torch.equal(a, b)
    post, comb = want[0], want[1]
    assert torch.equal(tm.hc_post(want[2], streams, post, comb),
                       _glm_reference("hc_post")(want[2], streams, post, comb))


@pytest.mark.parametrize("norm", [True, False], ids=["renormalised", "raw"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_router_kernels(dtype, norm):
    """20 experts (a partial block of 8, a padded select row), hidden 600 (two partial steps of 512): the
    same experts as the reference, weights within tolerance, zero elsewhere."""
    if not INTERPRETED:
        pytest.skip("runs in the interpreter subprocess")
    tr = importlib.import_module("backends.cuda.triton_router")
    g = torch.Generator().manual_seed(13)
    x, w = _r(g, 5, 600, dtype=dtype), _r(g, 20, 600, dtype=dtype, scale=0.05)
    bias = _r(g, 20, dtype=torch.float32, scale=0.1)
    assert tr.supports(x, w, bias, 4, 1) and not tr.supports(x, w, bias, 4, 2)
    got = tr.moe_router(x, w, bias, 4, norm, 2.5)
    want = _glm_reference("moe_router")(x.double(), w.double(), bias.double(), 4, 1, 1, norm, 2.5)
    assert got.dtype == dtype
    assert torch.equal(got != 0, want != 0) and ((got != 0).sum(1) == 4).all()
    _close(got, want, dtype)


# ---- KDA decode (backends/cuda/ops.py): the gates, the recurrence on pool rows in place ---------------------


@pytest.fixture(scope="module")
def cuda_ops():
    if not INTERPRETED:
        pytest.skip("runs in the interpreter subprocess")
    return importlib.import_module("backends.cuda.ops")


@pytest.mark.parametrize("lower", [-5.0, None], ids=["lower-bound", "softplus"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kda_gates(cuda_ops, dtype, lower):
    """3 tokens, 3 heads of 8 channels (two blocks of 16, the last partial); b a strided column slice of a
    wider projection as the model passes it; dt_bias float32 as loaded: g float32, beta in b's dtype."""
    g = torch.Generator().manual_seed(14)
    f = _r(g, 3, 24, dtype=dtype, scale=3.0)
    b = _r(g, 3, 40, dtype=dtype)[:, 30:33]
    dt_bias, a_log = _r(g, 24, dtype=torch.float32), _r(g, 3, dtype=torch.float32, scale=0.5)
    got = cuda_ops.kda_gates(f, b, dt_bias, a_log, lower)
    want = _glm_reference("kda_gates")(f.double(), b.double(), dt_bias.double(), a_log.double(), lower)
    assert got[0].dtype == torch.float32 and got[1].dtype == dtype
    _close(got[0], want[0], torch.float32 if dtype == torch.float32 else dtype)
    _close(got[1], want[1], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kda_recurrent_update_steps_pool_rows_in_place(cuda_ops, dtype):
    """3 sequences of 2 heads (Dk 8, Dv 6: one partial value block) whose q/k/v are column slices of one conv
    output, their states rows 4, 0, 2 of a pool of 5: those rows step once, the others stay as they were."""
    g = torch.Generator().manual_seed(15)
    n, h, dk, dv = 3, 2, 8, 6
    conv = _r(g, n, h * (2 * dk + dv), dtype=dtype)
    q, k, v = conv[:, : h * dk].view(n, h, dk), conv[:, h * dk: 2 * h * dk].view(n, h, dk), conv[:, 2 * h * dk:].view(n, h, dv)
    gate = -5.0 * torch.sigmoid(_r(g, n, h, dk, dtype=torch.float32))
    beta = torch.sigmoid(_r(g, n, h, dtype=dtype))
    pool = _r(g, 5, h, dk, dv, dtype=torch.float32, scale=0.3)
    slots = torch.tensor([4, 0, 2])
    want_pool = pool.double()
    want = _glm_reference("kda_recurrent_update")(q.double(), k.double(), v.double(), gate.double(), beta.double(),
                                                  want_pool, slots)
    before = pool.clone()
    got = cuda_ops.kda_recurrent_update(q, k, v, gate, beta, pool, slots)
    assert got.dtype == dtype
    _close(got, want, dtype)
    _close(pool, want_pool, torch.float32 if dtype == torch.float32 else dtype)
    assert torch.equal(pool[[1, 3]], before[[1, 3]])


@pytest.mark.parametrize("rows", [1, 5], ids=["1-row", "5-rows"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_skinny_linear_for_tuned_shapes(cuda_ops, dtype, rows, monkeypatch):
    """A weight shape in the tune table runs the Triton kernel (70 outputs: three blocks of 32, the last
    partial; 200 inputs: four steps of 64, the last partial), with and without bias; others the reference."""
    tgv = importlib.import_module("backends.cuda.triton_gemv")
    monkeypatch.setattr(tgv, "TUNED", {(70, 200): tgv._cfg(32, 64, 2)})
    calls = []
    monkeypatch.setattr(tgv, "skinny_linear", lambda *a, _f=tgv.skinny_linear: calls.append(1) or _f(*a))
    g = torch.Generator().manual_seed(16)
    x, w, b = _r(g, rows, 200, dtype=dtype), _r(g, 70, 200, dtype=dtype, scale=0.1), _r(g, 70, dtype=dtype)
    for bias in (None, b):
        got = cuda_ops.linear(x, w, bias)
        want = ref.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert got.dtype == dtype and got.shape == (rows, 70)
        _close(got, want, dtype)
    assert len(calls) == 2
    other = _r(g, 71, 200, dtype=dtype)
    assert torch.equal(cuda_ops.linear(x, other), ref.linear(x, other)) and len(calls) == 2
