// A llama-family decode step in one C++ call: the eager step's own kernels, in its order, without Python.
//
// A lone stream of a small 4-bit model on a 2-core CPU spends about a third of each token between kernels:
// ~300 calls a token through the interpreter and the dispatcher (or, compiled, through dynamo's and the
// generated wrapper's argument handling), while the second core spins. Here the same calls are plain C++
// function calls on tensors held by this object, so a token costs its kernels and little else, from the
// first request on (no compile).
//
// It computes exactly what the eager step (models/llama.py through backends/cpu/ops.py) computes on the
// same inputs: the same kernels (kernels.h) and torch's embedding rows, in the same order and dtypes.
// llama_step.py builds it only where the eager step would pick these kernels (packed weights, native
// attention, few rows); tests/test_cpu_llama_step.py checks the two agree bit for bit.

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "bf16.h"
#include "dynamic_for.h"
#include "kernels.h"

namespace {

// The logits' first `vocab` columns as float32, on the kernels' threads: Tensor::to would open an OpenMP
// region, whose worker then spins for milliseconds on a core the pool's worker needs (thread_pool.h).
at::Tensor widen(const at::Tensor& y, int64_t vocab) {
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && y.is_contiguous(), "LlamaStep: the head gives contiguous bf16 rows");
  const int64_t rows = y.size(0), stride = y.size(1);
  constexpr int64_t kPiece = 8192;
  const int64_t pieces = (vocab + kPiece - 1) / kPiece;
  at::Tensor out = at::empty({rows, vocab}, y.options().dtype(at::kFloat));
  const uint16_t* in = reinterpret_cast<const uint16_t*>(y.data_ptr<at::BFloat16>());
  float* o = out.data_ptr<float>();
  dynamic_for(rows * pieces, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t r = u / pieces, c0 = u % pieces * kPiece, c1 = std::min(vocab, c0 + kPiece);
      for (int64_t c = c0; c < c1; ++c) o[r * vocab + c] = as_float(in[r * stride + c]);
    }
  });
  return out;
}

namespace k = FLAGDEPLOY_OPS_NS;

// a weight-only linear: pieces of (nib, dm) of the int4 kernel or (w8, d) of the int8 kernel, told apart by
// dtype, their outputs side by side (one piece, or a fused qkv of a GGUF's Q4_K q, k beside its Q6_K v: the
// eager Linear's PiecewiseWeight); an empty bias is none. parts: the activations' int8 parts (q4_linear, q8_linear).
struct Linear {
  std::vector<std::pair<at::Tensor, at::Tensor>> pieces;
  at::Tensor bias;
  int64_t parts = 2;

  at::Tensor operator()(const at::Tensor& x) const {
    auto run = [&](const std::pair<at::Tensor, at::Tensor>& p) {
      return p.first.scalar_type() == at::kByte ? k::q4_linear(x, p.first, p.second, parts)
                                                : k::q8_linear(x, p.first, p.second, parts);
    };
    at::Tensor y;
    if (pieces.size() == 1) {
      y = run(pieces[0]);
    } else {
      std::vector<at::Tensor> ys;
      for (const auto& p : pieces) ys.push_back(run(p));
      y = at::cat(ys, 1);
    }
    return bias.numel() ? y + bias.to(y.scalar_type()) : y;
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;
};

class LlamaStep : public torch::CustomClassHolder {
 public:
  // t: embedding, final norm, the head's linear, the rope tables, then per layer its two norms, qkv / o / gate_up /
  // down and its k and v caches, a linear being two tensors a piece and its bias (see llama_step.py: `_tensors`);
  // dims: heads, kv heads, head dim, vocabulary, the int4 linears' activation parts, then the pieces of each
  // linear in that order
  LlamaStep(std::vector<at::Tensor> t, std::vector<int64_t> dims, double eps, double scale)
      : eps_(eps), scale_(scale) {
    TORCH_CHECK(dims.size() >= 6 && (dims.size() - 6) % 4 == 0, "LlamaStep: 5 sizes, then 1 + 4 per layer piece counts");
    heads_ = dims[0], kv_heads_ = dims[1], head_dim_ = dims[2], vocab_ = dims[3];
    const int64_t parts = dims[4];
    size_t at = 0, count = 5;
    auto next = [&]() {
      TORCH_CHECK(at < t.size(), "LlamaStep: fewer tensors than the piece counts take");
      return t[at++];
    };
    auto linear = [&]() {
      Linear l;
      for (int64_t i = 0, n = dims[count++]; i < n; ++i) {
        at::Tensor a = next();
        l.pieces.emplace_back(a, next());
      }
      l.bias = next();
      l.parts = parts;
      return l;
    };
    embed_ = next(), norm_ = next(), head_ = linear(), cos_ = next(), sin_ = next();
    while (count < dims.size()) {
      Layer l;
      l.input_norm = next(), l.post_norm = next();
      l.qkv = linear(), l.o = linear(), l.gate_up = linear(), l.down = linear();
      l.k_cache = next(), l.v_cache = next();
      layers_.push_back(std::move(l));
    }
    TORCH_CHECK(at == t.size(), "LlamaStep: more tensors than the piece counts take");
  }

  // ids, positions, slots, context lengths as the rows of `rows` [4, n]; tables [n, W] (int64); `out` the rows
  // whose logits are wanted (int64; empty: all of them, as a decode step's), e.g. a prompt's last row alone:
  // logits [len(out), vocab] in float32, or with head false the final norm's output of those rows (for the
  // caller's head: more rows than its packed kernel takes go to its dense copy, which the eager step calls from
  // Python)
  at::Tensor step(const at::Tensor& rows, const at::Tensor& tables, bool head, const at::Tensor& out) const {
    const int64_t n = rows.size(1);
    const at::Tensor ids = rows[0], positions = rows[1], slots = rows[2], ctx = rows[3];
    const int64_t q_width = heads_ * head_dim_, kv_width = kv_heads_ * head_dim_;
    const at::Tensor cos = cos_.index_select(0, positions), sin = sin_.index_select(0, positions);
    at::Tensor x = embed_.index_select(0, ids), residual, h;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      if (i == 0) {
        residual = x;
        h = k::rms_norm(x, l.input_norm, eps_);
      } else {
        std::tie(h, residual) = k::add_rms_norm(x, residual, l.input_norm, eps_);
      }
      at::Tensor qkv = l.qkv(h);
      at::Tensor q = qkv.narrow(1, 0, q_width).view({n, heads_, head_dim_});
      at::Tensor kk = qkv.narrow(1, q_width, kv_width).view({n, kv_heads_, head_dim_});
      at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width).view({n, kv_heads_, head_dim_});
      std::tie(q, kk) = k::rope_write_kv(q, kk, v, cos, sin, l.k_cache, l.v_cache, slots);
      at::Tensor a = k::paged_decode_attention(q, l.k_cache, l.v_cache, tables, ctx, scale_);
      std::tie(h, residual) = k::add_rms_norm(l.o(a.flatten(1)), residual, l.post_norm, eps_);
      x = l.down(k::swiglu(l.gate_up(h)));
    }
    if (out.numel() > 0 && out.numel() < n) {  // the head and the final norm for those rows only
      x = x.index_select(0, out), residual = residual.index_select(0, out);
    }
    h = std::get<0>(k::add_rms_norm(x, residual, norm_, eps_));
    return head ? widen(head_(h), vocab_) : h;
  }

  // Several decode steps of the same sequences in one call (vLLM's multi-step scheduling, --num-scheduler-steps):
  // each row's token is chosen here, as the engine's sampler chooses it (the argmax, or for a sampled row
  // `sample_probs` and `draw` at its next uniform, the argmax where nothing can be drawn), and is the row's input in
  // the next step. Each step is `step` over the rows still stepping, so every token is what that many single steps
  // would give, bit for bit; between them no Python runs and the pool's threads stay awake.
  // first [4, n]: the rows' first input ids, positions, context lengths and step counts (>= 1); slots [n, S] (a row's
  // cache slot at each of its steps); tables [n, W]; per row temperature (float32), top_k (int64), top_p, min_p
  // (float32) and sampled (bool); u [S, n] float64: a sampled row's uniform at each step. -> tokens [n, S] int64,
  // -1 past a row's count.
  at::Tensor steps(const at::Tensor& first, const at::Tensor& slots, const at::Tensor& tables,
                   const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                   const at::Tensor& min_p, const at::Tensor& sampled, const at::Tensor& u) const {
    const int64_t n = first.size(1), count = slots.size(1);
    TORCH_CHECK(first.dim() == 2 && first.size(0) == 4 && slots.size(0) == n && tables.size(0) == n &&
                    u.dim() == 2 && u.size(0) == count && u.size(1) == n && sampled.size(0) == n,
                "LlamaStep.steps: first [4, n], slots [n, S], tables [n, W], u [S, n], settings [n]");
    const auto f = first.accessor<int64_t, 2>();
    const auto sl = slots.accessor<int64_t, 2>();
    const auto pu = u.accessor<double, 2>();
    const auto draws = sampled.accessor<bool, 1>();
    const at::TensorOptions longs = first.options();
    at::Tensor tokens = at::full({n, count}, -1, longs);
    auto out = tokens.accessor<int64_t, 2>();
    std::vector<int64_t> ids(n);
    for (int64_t i = 0; i < n; ++i) ids[i] = f[0][i];
    const at::Tensor none = at::empty({0}, longs);
    for (int64_t s = 0; s < count; ++s) {
      std::vector<int64_t> live;  // rows still stepping
      for (int64_t i = 0; i < n; ++i)
        if (f[3][i] > s) live.push_back(i);
      if (live.empty()) break;
      const int64_t a = static_cast<int64_t>(live.size());
      at::Tensor rows = at::empty({4, a}, longs);
      auto r = rows.accessor<int64_t, 2>();
      for (int64_t j = 0; j < a; ++j) {
        const int64_t i = live[j];
        r[0][j] = ids[i], r[1][j] = f[1][i] + s, r[2][j] = sl[i][s], r[3][j] = f[2][i] + s;
      }
      const at::Tensor index = at::tensor(live, longs);
      const at::Tensor logits = step(rows, a == n ? tables : tables.index_select(0, index), true, none);
      const at::Tensor best = k::argmax_rows(logits);
      std::vector<int64_t> chosen(best.data_ptr<int64_t>(), best.data_ptr<int64_t>() + a), pick;
      for (int64_t j = 0; j < a; ++j)
        if (draws[live[j]]) pick.push_back(j);
      if (!pick.empty()) {  // the sampled rows together, as the engine's `sample` takes them
        const int64_t m = static_cast<int64_t>(pick.size());
        const at::Tensor rows_of = at::tensor(pick, longs), seqs_of = index.index_select(0, rows_of);
        at::Tensor uniforms = at::empty({m}, longs.dtype(at::kDouble));
        for (int64_t p = 0; p < m; ++p) uniforms.data_ptr<double>()[p] = pu[s][live[pick[p]]];
        const at::Tensor probs = k::sample_probs(logits.index_select(0, rows_of), temperature.index_select(0, seqs_of),
                                                 top_k.index_select(0, seqs_of), top_p.index_select(0, seqs_of),
                                                 min_p.index_select(0, seqs_of));
        const at::Tensor drawn = k::draw(probs, uniforms);
        for (int64_t p = 0; p < m; ++p)
          if (drawn.data_ptr<int64_t>()[p] >= 0) chosen[pick[p]] = drawn.data_ptr<int64_t>()[p];
      }
      for (int64_t j = 0; j < a; ++j) out[live[j]][s] = ids[live[j]] = chosen[j];
    }
    return tokens;
  }

 private:
  std::vector<Layer> layers_;
  at::Tensor embed_, norm_, cos_, sin_;
  Linear head_;
  int64_t heads_ = 0, kv_heads_ = 0, head_dim_ = 0, vocab_ = 0;
  double eps_, scale_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(FLAGDEPLOY_OPS_NS, m) {
  m.class_<LlamaStep>("LlamaStep")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, double, double>())
      .def("step", &LlamaStep::step)
      .def("steps", &LlamaStep::steps);
}
