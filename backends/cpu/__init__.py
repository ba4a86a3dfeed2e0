"""The cpu backend: always present; overrides the ops where torch's fused CPU kernels beat the reference."""

from flagdeploy.ops.registry import Backend

from . import llama_step, native, ops

backend = Backend(
    name="cpu",
    vendor="generic",
    device_type="cpu",
    dtypes=("float32", "bfloat16"),
    narrow_weight_dtypes=("bfloat16",) if ops.ONEDNN_BF16 else (),  # where oneDNN has bf16 matmuls (AMX, AVX512-BF16)
    compile_config=ops.TUNE["compile"],  # inductor settings for the compiled decode step
    decode_step=llama_step.build,  # the llama family's decode step in C++ (csrc/llama_step.cpp)
    server_threads=ops.server_threads,  # cores left to the server's own threads (tune.yaml's `serve`)
    collective="gloo",
    detect=lambda: True,
    overrides={
        "rms_norm": ops.rms_norm,
        "add_rms_norm": ops.add_rms_norm,
        "argmax": ops.argmax,
        "sample_probs": ops.sample_probs,
        "draw": ops.draw,
        "swiglu": ops.swiglu,
        "rope": ops.rope,
        "write_kv_cache": ops.write_kv_cache,
        "rope_write_kv": ops.rope_write_kv,
        "attention_prefill": ops.attention_prefill,
        "paged_attention_decode": ops.paged_attention_decode,
        "linear_w4a16": ops.linear_w4a16,
        "linear_w8a16": ops.linear_w8a16,
        "linear_w8a8_dynamic": ops.linear_w8a8_dynamic,
        "moe_experts": ops.moe_experts,
        "hc_pre": ops.hc_pre,
    },
    prepare={"linear_w4a16": ops.prepare_w4a16, "linear_w8a16": ops.prepare_w8a16, "moe_experts": ops.prepare_moe_banks,
             "linear": ops.prepare_linear},
    packed_weights=("linear_w4a16", "linear_w8a16"),
    int8_low_bits=lambda: native.holds_low_bits() and native.available(),
    q8_activations=ops.q8_activations,
    priority=0,
    description=("torch CPU kernels (oneDNN / AMX, fused SDPA, packed int8 GEMV, int8 x int8 matmul) and its own "
                 "int4 x int8 GEMV, AVX-512 VNNI or AVX2, and a llama decode step in C++ (csrc/, built on first use)"),
)
