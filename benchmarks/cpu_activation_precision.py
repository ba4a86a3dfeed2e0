"""What the int4 kernel's activation precision costs in accuracy, per linear: could some linears take one int8 part?

The cpu backend's few-row kernels (csrc/q4_linear.cpp, activations.h) quantise each activation block of 32 as
two int8 parts (~15 bits); the multiplies of a 5- or 16-row step are bound by their count, and one part (llama.cpp's
Q8_0 precision) halves it. The whole model in one part drifts too far (docs/performance.md, issue 54). This asks
whether a fixed choice per kind of linear would do: one part where the model is insensitive, two elsewhere. A
fixed choice keeps every row's result independent of the rows beside it, which speculative decoding's exactness
needs; a per-row-count one would not.

The default model (SmolLM2-135M GGUF) with its 4-bit weights dequantised exactly to float32, so that only the
activations differ: each linear's input is rounded to bf16 (what the kernels take) and then quantised as the
kernels do (absmax / 127 per block of 32, round half to even; two parts: hi + lo / 256), for every prompt position.
Besides fixed choices, a per-block one: the second part only on the blocks whose largest value is near their
row's largest (a row's result still depends on that row alone).
Against the same model with float activations, in the same run: mean and largest KL divergence of the next-token
distribution, top-1 agreement, largest relative logit difference (tests/test_quantized_weights.py bounds it at
0.1), and the share of the 4-bit linears' multiplies saved against two parts everywhere.

    python benchmarks/cpu_activation_precision.py
"""

from __future__ import annotations

import torch

from flagdeploy.checkpoints.source import resolve
from flagdeploy.engine import EngineConfig
from flagdeploy.engine.replica import build_llm_engine
from flagdeploy.models.attention import AttentionMetadata

KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
PROMPTS = ("Write two sentences about the ocean.", "What is the capital of France?",
           "Explain how a hash map works, briefly, in Python terms.",
           "def fib(n):\n    # return the n-th Fibonacci number\n",
           "Translate to French: The weather is nice today and we are going to the beach.")


def quantised(x: torch.Tensor, parts: int, lo_from: float, blocks: list[int], outputs: int) -> torch.Tensor:
    """x as the kernels see it: bf16, then per block of 32 one int8 part or two (activations.h). With lo_from > 0
    a block takes its second part only where its largest value is at least lo_from times its row's largest (the
    error of one part is its block's scale / 2 a value, so the small blocks' error is small); `blocks` counts the
    multiplies of all blocks and of those given two parts, in blocks x the linear's outputs."""
    shape, t = x.shape, x.to(torch.bfloat16).float().reshape(-1, 32)
    amax = t.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    t = t / scale
    hi = torch.round(t).clamp(-127, 127)
    per_row = amax.reshape(-1, shape[-1] // 32)
    two = (per_row >= lo_from * per_row.amax(-1, keepdim=True)).reshape(-1, 1) & (parts == 2)
    blocks[0] += two.numel() * outputs
    blocks[1] += int(two.sum()) * outputs
    q = hi + torch.where(two, torch.round((t - hi) * 256).clamp(-128, 127) / 256, 0)
    return (q * scale).reshape(shape).to(x.dtype)


def main() -> None:
    src = resolve(None)
    engine = build_llm_engine(src.path, src.format, EngineConfig(weight_format="dense", max_model_len=1024),
                              chip="cpu", progress=False)
    model, tok = engine.model, engine.tokenizer
    policy: dict[str, tuple[int, float]] = {}  # kind -> (parts, lo_from) (absent: float activations)
    blocks = [0, 0]  # the 4-bit linears' multiplies (blocks x outputs): all, and those of blocks in two parts

    def hook(kind: str):
        counts = blocks if kind != "lm_head" else [0, 0]
        return lambda m, args: (quantised(args[0], *policy[kind], counts, m.out_features), *args[1:]) \
            if kind in policy else None

    for name, mod in model.named_modules():
        kind = next((k for k in KINDS if name.endswith(k)), None)
        if kind is not None:
            mod.register_forward_pre_hook(hook(kind))

    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]

    def logits() -> list[torch.Tensor]:
        out = []
        for ids in prompts:  # every position's logits, through a scratch copy of the paged cache
            n, cu = len(ids), torch.tensor([0, len(ids)], dtype=torch.int32)
            meta = AttentionMetadata(positions=torch.arange(n), slot_mapping=torch.arange(n), num_prefill_tokens=n,
                                     cu_seqlens_q=cu, cu_seqlens_k=cu, prefill_kv_slots=None, block_tables=None,
                                     context_lens=None, logits_indices=torch.arange(n))
            caches = [[torch.zeros_like(c) for c in layer] for layer in engine.runner.kv_caches]
            with torch.no_grad():
                out.append(model(torch.tensor(ids), meta, caches).float())
        return out

    reference = logits()
    # kind -> 1 (one part) or the least share of its row's largest value that gives a block two parts (absent: 0)
    rows = {"two parts everywhere (the kernels)": {}, "one part everywhere (llama.cpp's Q8_0)": dict.fromkeys(KINDS, 1)}
    rows |= {f"one part: {k} only": {k: 1} for k in KINDS}
    rows |= {"one part: gate_up + down": {"gate_up_proj": 1, "down_proj": 1},
             "one part: o + gate_up + down": {"o_proj": 1, "gate_up_proj": 1, "down_proj": 1}}
    rows |= {f"second part where block max >= row max / {d}": dict.fromkeys(KINDS[:4], 1 / d) for d in (2, 4, 8, 16)}
    print(f"default model, {len(prompts)} prompts, {sum(map(len, prompts))} positions; against float activations")
    print(f"{'activations':48} {'mean KL':>9} {'max KL':>8} {'top-1':>6} {'max rel':>8} {'4-bit multiplies saved':>23}")
    for label, choice in rows.items():
        policy.clear()
        policy.update({k: (1, 0.0) if choice.get(k) == 1 else (2, choice.get(k, 0.0)) for k in KINDS})
        blocks[:] = [0, 0]
        kl, agree, rel = [], [], []
        for a, b in zip(reference, logits()):
            la, lb = a.log_softmax(-1), b.log_softmax(-1)
            kl.append((la.exp() * (la - lb)).sum(-1))
            agree.append((a.argmax(-1) == b.argmax(-1)).float())
            rel.append((a - b).norm(dim=-1) / a.norm(dim=-1))
        kl_all = torch.cat(kl)
        saved = (1 - blocks[1] / blocks[0]) / 2
        print(f"{label:48} {kl_all.mean():9.5f} {kl_all.max():8.4f} {torch.cat(agree).mean():6.3f} "
              f"{torch.cat(rel).max():8.3f} {saved:22.0%}")


if __name__ == "__main__":
    main()
