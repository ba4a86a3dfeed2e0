"""GLM-5.3-Flash 4-layer slice at true dims on one GPU: our model against transformers and the hardware.

    python benchmarks/h200_glm5_slice.py [--batches 1,8] [--context 256] [--steps 20] [--profile [--trace DIR]]
    python benchmarks/h200_glm5_slice.py --tiny        # the same logic on the CPU at toy size

The slice: layers 0-2 KDA (linear_attention), layer 3 MLA + DSA indexer (indexed_attention), every layer
MoE (288 routed experts of 2048, 8 per token, 1 shared expert), hidden 4096, 64 heads, 4 mHC streams:
transformers 5.23's `Glm5NextTextConfig` defaults with num_hidden_layers=4 and all-sparse MLPs.
Random bf16 weights of the real shapes, drawn on the GPU (N(0, 0.02), norm scales 1: the recipe of
`engine.model_loading.init_dummy_weights`, which draws on the CPU and would take minutes at this size); our
`Glm5NextForCausalLM` is built directly, and transformers' `Glm5NextTextModel` is given the very same
tensors (aliased, no copy), so both run identical weights. The LM head is left out of both (it is no
layer): our model's head is an identity, transformers' text model has none; both return the final
normed hidden states.

Correctness first: (1) both models in float32 at the true dims on the same weights (aliased: ~120 GB
fits once), prefill hidden states and one decode step, relative RMS error under 1e-3; (2) the timed
dtype (bf16, the same weights rounded): our error against that float32 reference within twice
transformers' own bf16 error; (3) every CUDA override on the path (`moe_experts` and the ones in
NEW_OVERRIDES) against its op's reference at the true dims.

Then decode time per layer = (time of one decode step of the whole slice) / 4 at each batch size, after a
prefill of --context tokens per sequence and warm-up steps, the best of a few blocks of steps; ours is timed through `model.forward_packed(ids, cu_seqlens, caches)` directly (what the engine's
SequenceStateRunner calls each step, without the scheduler), transformers through its text model's
forward with its own cache. The limit per layer is the bytes one decode step must read per layer
(attention weights, router, shared expert, the routed experts the batch actually touched, and the KDA
state / MLA cache rows read and written) over the copy bandwidth measured in the same run, once with
every weight in bf16 and once with the routed and shared experts in FP8 (1 byte + a float32 scale per
128x128 block), as the published checkpoint stores them.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import time

import torch
from torch import nn

from flagdeploy import ops
from flagdeploy.models.glm5_next import (
    ExpertBank,
    Glm5NextForCausalLM,
    KdaAttention,
    MlaAttention,
    _canonical,
    from_hf_config,
)
from flagdeploy.models.linear import Linear
from flagdeploy.ops import glm as glm_ops
from flagdeploy.ops.registry import OPS

LAYERS = 4
# CUDA overrides added for this benchmark: also timed on their references (an A/B in the same run)
NEW_OVERRIDES = ["hc_pre", "hc_post", "kda_gates", "kda_recurrent", "kda_recurrent_update", "sparse_attention",
                 "moe_router", "gated_rms_norm", "dsa_indexer_topk"]
TRUE = dict(num_hidden_layers=LAYERS, vocab_size=154880,  # noqa: C408
            layer_types=["linear_attention"] * 3 + ["indexed_attention"],
            mlp_layer_types=["sparse"] * LAYERS, pad_token_id=0)
TINY = {**TRUE, **dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,  # noqa: C408
                        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2,
                        kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, v_head_dim=8, index_topk=8,
                        index_head_dim=8, index_n_heads=8, index_kpool=4, linear_head_dim=8, linear_num_heads=2,
                        hc_mult=3, hc_sinkhorn_iters=5)}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sync_time(fn) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy, bytes read + written per second, best of 5 (4 GiB; 64 MiB on the CPU)."""
    n = (4 << 30) if device == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return max(2 * n / sync_time(lambda: dst.copy_(src)) for _ in range(5))


# ---- the two models on the same weights ----------------------------------------------------------------


def build_ours(text: dict, dtype: torch.dtype, device: str, seed: int = 0, head: bool = False,
               mtp: bool = False) -> Glm5NextForCausalLM:
    """head: keep a random LM head (else an identity: the final normed hidden states come out);
    mtp: attach the multi-token-prediction draft layer, random too (benchmarks/h200_glm5_speculative.py)."""
    cfg = from_hf_config({"model_type": "glm5_next_text", **text})
    with torch.device(device):
        model = Glm5NextForCausalLM(cfg, dtype).eval()
        if mtp:
            model.attach_mtp()
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(shape, like_dtype):  # drawn in float32 whatever the dtype: a bf16 build is the float32 one rounded
        return torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=gen).to(like_dtype)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                for chunk in p if p.dim() > 2 else [p]:  # expert banks a slice at a time
                    chunk.copy_(draw(chunk.shape, p.dtype))
        for m in model.modules():
            if isinstance(m, Linear) and (head or m is not model.lm_head):
                m._pending.clear()
                m.weight = draw((m.out_features, m.in_features), m.dtype)
                m.bias = torch.zeros(m.out_features, dtype=m.dtype, device=device) if m.has_bias else None
    if not head:
        model.lm_head = nn.Identity()  # no LM head: forward_packed returns the final normed hidden states
    return model


def linear_part(lin: Linear, part: str) -> torch.Tensor:
    """Rows of a fused Linear's weight belonging to checkpoint part `part` (a view; one process, no TP)."""
    if len(lin.parts) == 1:
        return lin.weight
    start = sum(lin.part_rows[p] for p in lin.parts[: lin.parts.index(part)])
    return lin.weight[start: start + lin.part_rows[part]]


def ours_for_hf_name(model: Glm5NextForCausalLM, slots: dict, name: str, like: torch.Tensor) -> torch.Tensor:
    """Our tensor (a view where possible) for transformers' state-dict entry `name` (shape of `like`)."""
    canon = _canonical(name)
    layer_idx = int(canon.split(".")[1]) if canon.startswith("layers.") else None
    if canon.endswith("mlp.experts.gate_up_proj"):
        t = model.layers[layer_idx].mlp.experts.gate_up
    elif canon.endswith("mlp.experts.down_proj"):
        t = model.layers[layer_idx].mlp.experts.down
    elif canon.endswith("self_attn.conv1d.weight"):
        t = model.layers[layer_idx].attn.conv_weight
    else:
        slot = slots[canon]
        t = slot[0] if len(slot) == 2 else (linear_part(slot[0], slot[1]) if slot[2] == "weight" else slot[0].bias)
    if t.numel() != like.numel():
        raise RuntimeError(f"{name}: ours {tuple(t.shape)} vs transformers {tuple(like.shape)}")
    return t.view(like.shape)


def build_theirs(model: Glm5NextForCausalLM, text: dict, device: str):
    """transformers' Glm5NextTextModel holding exactly our model's tensors (aliased)."""
    from transformers import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    config = Glm5NextTextConfig(**text)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = Glm5NextTextModel(config)
    slots = model.weight_slots()
    state = {}
    for name, t in hf.state_dict().items():
        state[name] = ours_for_hf_name(model, slots, name, t)
    missing, unexpected = hf.load_state_dict(state, strict=True, assign=True)
    leftovers = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if missing or unexpected or leftovers:
        raise RuntimeError(f"weights not carried over: missing {missing[:5]} left on meta {leftovers[:5]}")
    return hf.eval()


# ---- running ----------------------------------------------------------------------------------------------


def prompts(batch: int, length: int, vocab: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=g).to(device)


class Ours:
    def __init__(self, model):
        self.model = model

    def prefill(self, ids: torch.Tensor):
        b, t = ids.shape
        self.caches = [self.model.new_cache() for _ in range(b)]
        cu = torch.arange(b + 1) * t
        return self.model.forward_packed(ids.flatten(), cu, self.caches).view(b, t, -1)

    def step(self, ids: torch.Tensor):
        b = ids.shape[0]
        return self.model.forward_packed(ids.flatten(), torch.arange(b + 1), self.caches).view(b, 1, -1)


class Engine:
    """Ours as the engine runs it: the runner's pools, `forward_decode` for decode steps, CUDA graphs
    (captured on the first step of each batch size) unless `graphs` is off; no scheduler around it."""

    def __init__(self, model, graphs: bool, max_len: int, block_size: int = 16):
        self.model, self.graphs, self.max_len, self.bs = model, graphs, max_len, block_size

    def prefill(self, ids: torch.Tensor):
        from flagdeploy.engine.model_runner import SequenceStateRunner, StateStep

        b, t = ids.shape
        per = -(-self.max_len // self.bs)
        device = str(ids.device.type)
        self.runner = SequenceStateRunner(self.model, b * per, self.bs, device, b,
                                          {"max_model_len": self.max_len} if self.graphs and device == "cuda" else None)
        self.tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
        self.length = t
        step = StateStep([(i, i, self.tables[i], ids[i].tolist(), 0) for i in range(b)], [(i + 1) * t - 1 for i in range(b)])
        return self.runner.execute(step)

    def step(self, ids: torch.Tensor):
        from flagdeploy.engine.model_runner import StateStep

        b = ids.shape[0]
        step = StateStep([(i, i, self.tables[i], [int(ids[i, 0])], self.length) for i in range(b)], list(range(b)))
        self.length += 1
        return self.runner.execute(step).view(b, 1, -1)


class Theirs:
    def __init__(self, model):
        self.model = model

    def prefill(self, ids: torch.Tensor):
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            return self.model(input_ids=ids, past_key_values=self.cache, use_cache=True).last_hidden_state.float()

    def step(self, ids: torch.Tensor):
        with torch.inference_mode():
            return self.model(input_ids=ids, past_key_values=self.cache, use_cache=True).last_hidden_state.float()


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_check(runner, vocab: int, context: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states of a 2-sequence prefill and of one decode step after it (float32, CPU)."""
    pre = runner.prefill(prompts(2, context, vocab, device, seed=1))
    dec = runner.step(prompts(2, 1, vocab, device, seed=2))
    return pre.float().cpu(), dec.float().cpu()


def compare(a: tuple, b: tuple) -> tuple[float, float, float]:
    """(prefill rel RMS err, decode rel RMS err, worst per-token cosine of the prefill)."""
    cos = torch.nn.functional.cosine_similarity(a[0].flatten(0, 1), b[0].flatten(0, 1), -1).min().item()
    return rel_rms(a[0], b[0]), rel_rms(a[1], b[1]), cos


def check_moe_override(model: Glm5NextForCausalLM, device: str, dtype: torch.dtype, gate_up, down, what: str,
                       tokens: tuple[int, ...], top_k: int | None = None, tol: float = 0.02) -> str:
    """The active backend's moe_experts on the banks given (bf16: grouped GEMM on Hopper; FP8: the Triton
    kernels at decode sizes) against the op's reference, true dims."""
    c = model.cfg
    out = []
    for t in tokens:
        g = torch.Generator(device=device).manual_seed(t)
        x = torch.randn(t, c.hidden_size, generator=g, device=device, dtype=dtype)
        w = torch.randn(t, c.n_routed_experts, generator=g, device=device, dtype=torch.float32)
        top = w.topk(c.num_experts_per_tok, dim=-1)
        routing = torch.zeros_like(w).scatter_(1, top.indices, top.values.abs()).to(dtype)
        fast = glm_ops.moe_experts(x, routing, gate_up, down, c.swiglu_limit, top_k=top_k)
        ref = OPS["moe_experts"].reference(x, routing, gate_up, down, c.swiglu_limit)
        err = rel_rms(fast, ref)
        if err > tol:
            raise SystemExit(f"MISMATCH: {what} ({ops.active_backend().name}) vs reference at {t} tokens: {err:.2e}")
        out.append(f"{t} tok {err:.1e}")
    return f"{what} ({ops.active_backend().name}) vs its reference, rel RMS err: " + ", ".join(out)


def fp8_expert_banks(model: Glm5NextForCausalLM) -> list[tuple]:
    """Each layer's routed experts quantised to FP8 e4m3 with 128x128 block scales (the published
    checkpoint's format), as (bank, FP8 gate_up, FP8 down); `use_experts` swaps them in and out."""
    from flagdeploy.ops.weights import Fp8BlockWeight

    banks = [m for m in model.modules() if isinstance(m, ExpertBank)]
    return [(b, Fp8BlockWeight.quantize(b.gate_up), Fp8BlockWeight.quantize(b.down)) for b in banks]


def use_experts(fp8: list[tuple], on: bool, dense: dict) -> None:
    """Swap the FP8 banks in (on) or the dense bf16 parameters back (dense: bank -> (gate_up, down))."""
    for bank, gate_up, down in fp8:
        if on:
            dense.setdefault(bank, (bank.gate_up, bank.down))
            del bank.gate_up, bank.down
            bank.gate_up, bank.down = gate_up, down
        else:
            del bank.gate_up, bank.down
            bank.gate_up, bank.down = dense[bank]


def check_new_overrides(model: Glm5NextForCausalLM, device: str, dtype: torch.dtype) -> str:
    """Each override added for this benchmark against its op's reference, at the true dims of its call."""
    from flagdeploy.ops import registry

    c = model.cfg
    hc, kda = model.layers[0].attn_hc, model.layers[0].attn
    g = torch.Generator(device=device).manual_seed(11)

    def rnd(*shape, dt=dtype, scale=1.0):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).mul(scale).to(dt)

    def cases(t: int):
        h, dk, s = c.linear_num_heads, c.linear_head_dim, 300
        yield "hc_pre", (rnd(t, c.hc_mult, c.hidden_size), hc.fn, hc.base, hc.scale, c.rms_norm_eps, c.hc_eps,
                         c.hc_sinkhorn_iters)
        yield "hc_post", (rnd(t, c.hidden_size), rnd(t, c.hc_mult, c.hidden_size), rnd(t, c.hc_mult),
                          torch.rand(t, c.hc_mult, c.hc_mult, generator=g, device=device).to(dtype))
        yield "kda_gates", (rnd(t, h * dk), rnd(t, h), kda.dt_bias, kda.A_log, c.linear_lower_bound)
        yield "kda_recurrent_update", (rnd(t, h, dk), rnd(t, h, dk), rnd(t, h, dk),
                                       -5 * torch.sigmoid(rnd(t, h, dk, dt=torch.float32)), torch.sigmoid(rnd(t, h)),
                                       rnd(t + 3, h, dk, dk, dt=torch.float32, scale=0.3),
                                       torch.randperm(t + 3, generator=g, device=device)[:t])
        yield "kda_recurrent", (rnd(t, h, dk), rnd(t, h, dk), rnd(t, h, dk),
                                -5 * torch.sigmoid(rnd(t, h, dk, dt=torch.float32)), torch.sigmoid(rnd(t, h)),
                                rnd(h, dk, dk, dt=torch.float32, scale=0.3))
        lat = rnd(s, c.kv_lora_rank).unsqueeze(1).expand(-1, c.num_heads, -1)
        mask = (torch.rand(t, s, generator=g, device=device) < 0.7).to(dtype)
        mask[:, -1] = 1
        yield "sparse_attention", (rnd(t, c.num_heads, c.kv_lora_rank), lat, lat, mask, c.qk_nope_head_dim**-0.5)
        yield "gated_rms_norm", (rnd(t, h, dk), rnd(t, h, dk), kda.o_norm, c.rms_norm_eps)
        ix = next(layer.attn.indexer for layer in model.layers if isinstance(layer.attn, MlaAttention))
        ctx = 300 + t  # within the top-k budget (the shortcut) at every batch size used here
        yield "dsa_indexer_topk", (rnd(t, c.index_n_heads, c.index_head_dim), rnd(t, c.index_n_heads),
                                   rnd(ctx, c.index_head_dim), rnd(ctx, c.index_head_dim), ix.compress_ape, ctx - t,
                                   c.index_topk, c.index_kpool_always_select_tail)
        mlp = model.layers[0].mlp
        yield "moe_router", (rnd(t, c.hidden_size), mlp.router, mlp.correction_bias, c.num_experts_per_tok, c.n_group,
                             c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)

    worst: dict[str, float] = {}
    for t in (1, 8, 64):
        for name, args in cases(t):
            spec = OPS[name]

            def call(fn):  # on copies of what the op writes in place (a state pool); those compared too
                a = [x.clone() if i in spec.writes else x for i, x in enumerate(args)]
                return spec.outputs(fn(*a), a)

            fast, ref = call(registry._active[name]), call(spec.reference)
            err = max((a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-30)
                      for a, b in zip(fast, ref))
            if err > (1e-5 if dtype == torch.float32 else 2e-2):
                raise SystemExit(f"MISMATCH: {name} ({ops.active_backend().name}) vs reference at {t} tokens: {err:.2e}")
            worst[name] = max(worst.get(name, 0.0), err)
    return (f"{ops.active_backend().name} overrides vs their references (1, 8, 64 tokens), worst max-abs-err / max-abs: "
            + ", ".join(f"{n} {e:.1e}" for n, e in worst.items()))


def with_reference(names: list[str]):
    """Context: the named ops run their reference instead of the backend's override (for an A/B)."""
    import contextlib

    from flagdeploy.ops import registry

    @contextlib.contextmanager
    def cm():
        saved = {n: registry._active[n] for n in names}
        registry._active.update({n: OPS[n].reference for n in names})
        try:
            yield
        finally:
            registry._active.update(saved)
    return cm()


def time_decode(runner, batch: int, context: int, steps: int, vocab: int, device: str, warmup: int = 3,
                blocks: int = 3) -> float:
    """Seconds per decode step at `batch` sequences after a prefill of `context` tokens each: the best of
    `blocks` consecutive blocks of steps (the mean step time within each; the context grows throughout)."""
    runner.prefill(prompts(batch, context, vocab, device, seed=3))
    per = max(steps // blocks, 1)
    toks = prompts(batch, warmup + per * blocks, vocab, device, seed=4)
    best = float("inf")
    with torch.inference_mode():
        for i in range(warmup):
            runner.step(toks[:, i: i + 1])
        for blk in range(blocks):
            sync()
            t0 = time.perf_counter()
            for i in range(warmup + blk * per, warmup + (blk + 1) * per):
                runner.step(toks[:, i: i + 1])
            sync()
            best = min(best, (time.perf_counter() - t0) / per)
    return best


# ---- the limit ------------------------------------------------------------------------------------------


def tensor_bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def layer_bytes(model: Glm5NextForCausalLM, touched: list[int], batch: int, context: int, fp8_experts: bool) -> list[int]:
    """Bytes one decode step reads per layer: every non-expert weight once, the shared expert and the
    touched routed experts (bf16, or FP8 + block scales), plus per-sequence state read and written."""
    c = model.cfg
    out = []
    for layer, n_touched in zip(model.layers, touched):
        dense = sum(tensor_bytes(p) for n, p in layer.named_parameters() if "experts.gate_up" not in n
                    and "experts.down" not in n)
        shared = 0
        for m in layer.modules():
            if isinstance(m, Linear):
                b = tensor_bytes(m.weight)
                if m in (layer.mlp.shared.gate_up_proj, layer.mlp.shared.down_proj):
                    shared += b
                else:
                    dense += b
        per_expert = 3 * c.moe_intermediate_size * c.hidden_size
        if fp8_experts:
            shared = shared // 2 + 4 * math.ceil(shared / 2 / 128**2)
            routed = n_touched * (per_expert + 4 * math.ceil(per_expert / 128**2))
        else:
            routed = n_touched * per_expert * 2
        if isinstance(layer.attn, KdaAttention):  # fp32 recurrent state and the conv taps, read and written
            width = c.linear_num_heads * c.linear_head_dim
            st = c.linear_num_heads * c.linear_head_dim**2 * 4 + (c.linear_conv_kernel_dim - 1) * 3 * width * 2
            state = 2 * batch * st
        else:  # the cached latent and indexer rows of `context` tokens, read
            assert isinstance(layer.attn, MlaAttention)
            state = batch * context * (c.kv_lora_rank + 2 * c.index_head_dim) * 2
        out.append(dense + shared + routed + state)
    return out


def touched_experts(ours: Ours, batch: int, context: int, vocab: int, device: str) -> list[int]:
    """Distinct routed experts each layer's MoE used in one decode step at `batch` (counted, not assumed)."""
    seen: list[int] = []
    real = glm_ops.moe_router

    def counting(*a, **k):
        r = real(*a, **k)
        seen.append(int((r != 0).any(0).sum().item()))
        return r

    ours.prefill(prompts(batch, context, vocab, device, seed=5))
    glm_ops.moe_router = counting
    try:
        ours.step(prompts(batch, 1, vocab, device, seed=6))
    finally:
        glm_ops.moe_router = real
    return seen


def profile_step(ours, batch: int, context: int, vocab: int, device: str, top: int = 15, trace: str | None = None) -> str:
    from torch.profiler import ProfilerActivity, profile

    ours.prefill(prompts(batch, context, vocab, device, seed=7))
    toks = prompts(batch, 4, vocab, device, seed=8)
    with torch.inference_mode():
        ours.step(toks[:, :1])
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(1, 4):
                ours.step(toks[:, i: i + 1])
            sync()
    if trace:  # every kernel in order, for chrome://tracing or a script that groups them by layer
        prof.export_chrome_trace(os.path.join(trace, f"glm5_slice_decode_batch{batch}.json"))
    events = prof.key_averages()
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    table = events.table(sort_by=key, row_limit=top, max_name_column_width=60)
    n_launch = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    return f"profile of 3 decode steps at batch {batch}: {n_launch / 3:.0f} kernel launches per step\n{table}"


# ---- main -----------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per sequence before decoding")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps (ours)")
    ap.add_argument("--theirs-steps", type=int, default=5, help="timed decode steps (transformers, slow)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler top kernels of the CUDA-graph decode step")
    ap.add_argument("--trace", metavar="DIR", help="with --profile: write each batch's chrome trace there")
    ap.add_argument("--tiny", action="store_true", help="toy size on the CPU in float32 (checks the script)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.tiny:
        device, dtype, text, tol32 = "cpu", torch.bfloat16, TINY, 1e-4
        args.context, args.steps, args.theirs_steps = min(args.context, 24), min(args.steps, 3), min(args.theirs_steps, 2)
    else:
        device, dtype, text, tol32 = "cuda", torch.bfloat16, TRUE, 1e-3
    ops.use_backend("cuda" if device == "cuda" else "cpu")
    torch.manual_seed(0)
    vocab, check_len = text["vocab_size"], min(args.context, 64)

    bw = copy_bandwidth(device)
    # 1. exactness at true dims: both models in float32 on the same weights (aliased: 120 GB, fits once)
    t0 = time.perf_counter()
    model = build_ours(text, torch.float32, device)
    ours32 = run_check(Ours(model), vocab, check_len, device)
    ref32 = run_check(Theirs(build_theirs(model, text, device)), vocab, check_len, device)
    e_pre, e_dec, cos = compare(ours32, ref32)
    checks = [(f"float32, same weights, {check_len}-token prefill x 2 seqs + 1 decode step, ours vs transformers: "
               f"rel RMS err prefill {e_pre:.1e} decode {e_dec:.1e}, worst token cosine {cos:.6f} "
               f"(tolerance {tol32:g})")]
    if max(e_pre, e_dec) > tol32:
        raise SystemExit("MISMATCH: " + checks[-1])
    del model
    gc.collect()
    sync()
    if device == "cuda":
        torch.cuda.empty_cache()
    # 2. the timed dtype: the same weights rounded; our error against the float32 reference must stay
    # within twice transformers' own error in that dtype (the format's noise: random routers have near-ties)
    model = build_ours(text, dtype, device)
    hf = build_theirs(model, text, device)
    build_s = time.perf_counter() - t0
    ours, theirs = Ours(model), Theirs(hf)
    o_pre, o_dec, o_cos = compare(run_check(ours, vocab, check_len, device), ref32)
    t_pre, t_dec, t_cos = compare(run_check(theirs, vocab, check_len, device), ref32)
    checks.append(f"{str(dtype)[6:]} vs that float32 reference, rel RMS err prefill / decode / worst cosine: ours "
                  f"{o_pre:.3f} / {o_dec:.3f} / {o_cos:.3f}, transformers {t_pre:.3f} / {t_dec:.3f} / {t_cos:.3f}")
    if max(o_pre, o_dec) > max(2 * max(t_pre, t_dec), 0.02):
        raise SystemExit("MISMATCH: " + checks[-1])
    max_len = args.context + 3 + args.steps + 8
    graphed = Engine(model, True, max(max_len, check_len + 8))
    graphed.prefill(prompts(2, check_len, vocab, device, seed=1))
    g_dec = rel_rms(graphed.step(prompts(2, 1, vocab, device, seed=2)).float().cpu(), ref32[1])
    checks.append(f"{str(dtype)[6:]} decode step through the engine's runner (forward_decode, CUDA graph) vs the float32 "
                  f"reference: rel RMS err {g_dec:.3f}")
    if g_dec > max(2 * max(t_pre, t_dec), 0.02):
        raise SystemExit("MISMATCH: " + checks[-1])
    bank = next(m for m in model.modules() if isinstance(m, ExpertBank))
    checks.append(check_moe_override(model, device, dtype, bank.gate_up, bank.down, "moe_experts", (1, 8, 64)))
    fp8 = fp8_expert_banks(model)
    dense_banks: dict = {}
    checks.append(check_moe_override(model, device, dtype, fp8[0][1], fp8[0][2], "moe_experts on FP8 banks", (1, 8),
                                     top_k=model.cfg.num_experts_per_tok))
    checks.append(check_new_overrides(model, device, dtype))
    for line in checks:
        print(line, flush=True)

    rows = []
    for b in batches:
        mine = time_decode(ours, b, args.context, args.steps, vocab, device)
        eager = time_decode(Engine(model, False, max_len), b, args.context, args.steps, vocab, device)
        graphs = time_decode(Engine(model, True, max_len), b, args.context, args.steps, vocab, device)
        use_experts(fp8, True, dense_banks)
        graphs8 = time_decode(Engine(model, True, max_len), b, args.context, args.steps, vocab, device)
        use_experts(fp8, False, dense_banks)
        with with_reference(NEW_OVERRIDES):
            before = time_decode(ours, b, args.context, args.steps, vocab, device)
        touched = touched_experts(ours, b, args.context, vocab, device)
        ours.caches = None
        theirs_s = time_decode(theirs, b, args.context, args.theirs_steps, vocab, device, warmup=1, blocks=2)
        theirs.cache = None
        mean_ctx = args.context + (3 + args.steps) / 2
        lim16 = sum(layer_bytes(model, touched, b, int(mean_ctx), False)) / bw / LAYERS
        lim8 = sum(layer_bytes(model, touched, b, int(mean_ctx), True)) / bw / LAYERS
        rows.append((b, theirs_s / LAYERS, lim16, lim8, mine / LAYERS, touched, before / LAYERS, eager / LAYERS,
                     graphs / LAYERS, graphs8 / LAYERS))
        print(f"batch {b}: ours {mine / LAYERS * 1e3:.3f} ms/layer (engine decode {eager / LAYERS * 1e3:.3f}, CUDA graph "
              f"{graphs / LAYERS * 1e3:.3f}, FP8 experts {graphs8 / LAYERS * 1e3:.3f}), transformers {theirs_s / LAYERS * 1e3:.3f} ms/layer, experts touched per layer "
              f"{touched}", flush=True)
    if args.profile:  # what the served decode step spends its time on: the graph's kernels (FP8 experts)
        use_experts(fp8, True, dense_banks)
        for b in batches:
            print(profile_step(Engine(model, True, max_len), b, args.context, vocab, device, top=30,
                                 trace=args.trace))
        use_experts(fp8, False, dense_banks)

    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    import transformers
    print(f"\n{name}  torch {torch.__version__}  transformers {transformers.__version__}  copy {bw / 1e9:.0f} GB/s  "
          f"(models built in {build_s:.0f} s)")
    for line in checks:
        print(line)
    print(f"decode, context {args.context} + {args.steps} steps; ms per layer (step time / {LAYERS}); limit = bytes read "
          f"per layer / copy bandwidth")
    print(f"{'workload':<16}{'transformers':>13}{'limit bf16':>11}{'limit fp8x':>11}{'packed':>8}{'ref ops':>8}"
          f"{'decode':>8}{'graph':>8}{'graph fp8x':>11}{'fp8x/lim8':>10}{'tf/graph':>9}{'tf/fp8x':>8}  experts touched")
    for b, tf, l16, l8, mine, touched, before, eager, graphs, graphs8 in rows:
        print(f"{f'decode batch {b}':<16}{tf * 1e3:13.3f}{l16 * 1e3:11.3f}{l8 * 1e3:11.3f}{mine * 1e3:8.3f}"
              f"{before * 1e3:8.3f}{eager * 1e3:8.3f}{graphs * 1e3:8.3f}{graphs8 * 1e3:11.3f}{graphs8 / l8:10.2f}"
              f"{tf / graphs:9.1f}{tf / graphs8:8.1f}  {touched}")
    print("ms per layer. 'packed': ours through forward_packed (per-sequence caches, eager); 'ref ops': the same with "
          f"{', '.join(NEW_OVERRIDES)} on their reference; 'decode': the engine's runner, forward_decode eager; "
          "'graph': the same replayed as a CUDA graph (what `flagdeploy serve` runs on a GPU); 'graph fp8x': the same "
          "with the routed experts in FP8 (128x128 block scales, Triton kernels), the published checkpoint's format")


if __name__ == "__main__":
    main()
