// The kernels' entry points, declared for code in this library that strings several of them together
// without the dispatcher (llama_step.cpp: a whole decode step, where ~300 calls a token through Python
// cost more than the norms and rope themselves). Each is also a torch op of the same name.
#pragma once

#include <ATen/ATen.h>

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

}  // namespace FLAGDEPLOY_OPS_NS
