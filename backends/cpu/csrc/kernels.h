// The kernels' entry points, declared for code in this library that strings several of them together
// without the dispatcher (llama_step.cpp: a whole decode step, where ~300 calls a token through Python
// cost more than the norms and rope themselves). Each is also a torch op of the same name.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

#include "ops_ns.h"

namespace FLAGDEPLOY_OPS_NS {

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& nib, const at::Tensor& dm, int64_t parts = 2);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w8, const at::Tensor& d, int64_t parts);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                double eps);
std::tuple<at::Tensor, at::Tensor> rope_write_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                                                 at::Tensor v_cache, const at::Tensor& slots);
at::Tensor swiglu(const at::Tensor& gate_up);
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor sample_probs(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                        const at::Tensor& top_p, const at::Tensor& min_p);
at::Tensor draw(const at::Tensor& probs, const at::Tensor& u);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale);

// The same kernels on raw rows (bf16 as uint16_t), for a caller that owns its buffers: llama_step.cpp's step, where each
// op's tensors (allocation, views, the dispatcher) cost more than its arithmetic at a few rows, their code and data
// cold after every linear's weight has gone through the caches. The layer ops above are their checks and tensors
// around these.
struct Activations;  // activations.h
void q4_linear_into(const Activations& a, int64_t rows, int64_t k, const uint8_t* nib, const uint16_t* dm, int64_t n_tiles,
                    bool one, uint16_t* y, int64_t ldy);
void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t n, float eps);
void rms_norm_rows(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t rows, int64_t n, float eps);
// h = x + r (h may be r), out = its norm
void add_rms_norm_rows(const uint16_t* x, const float* r, const float* w, float* h, float* out, int64_t rows, int64_t n,
                       float eps);
void add_rms_norm_rows(const uint16_t* x, const uint16_t* r, const uint16_t* w, uint16_t* h, uint16_t* out, int64_t rows,
                       int64_t n, float eps);
// qkv: rows of a fused projection's output, ld values apart (q, then k, then v); cos / sin: rope tables, rows cs apart,
// read at each row's position; the rotated q to q_out [rows, heads, d], the rotated k and v to the rows' cache slots
void rope_write_kv_rows(const uint16_t* qkv, int64_t ld, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d,
                        const float* cos, const float* sin, int64_t cs, const int64_t* positions, const int64_t* slots,
                        uint16_t* k_cache, uint16_t* v_cache, uint16_t* q_out);
// q32, out32: rows x heads x d floats of scratch
void paged_decode_attention_rows(const uint16_t* q, int64_t rows, int64_t heads, int64_t d, const uint16_t* k_cache,
                                 const uint16_t* v_cache, int64_t kv_heads, int64_t block_size, const int64_t* tables,
                                 int64_t width, const int64_t* lens, float scale, float* q32, float* out32, uint16_t* out);
// x: rows of gate then up, stride values apart
void swiglu_rows(const uint16_t* x, int64_t stride, int64_t rows, int64_t n, uint16_t* out);

}  // namespace FLAGDEPLOY_OPS_NS
