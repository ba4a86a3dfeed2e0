// A llama-family decode step in one C++ call: the eager step's own kernels, in its order, without Python.
//
// A lone stream of a small 4-bit model on a 2-core CPU spends about a third of each token between kernels:
// ~300 calls a token through the interpreter and the dispatcher (or, compiled, through dynamo's and the
// generated wrapper's argument handling), while the second core spins. Here the same calls are plain C++
// function calls, so a token costs its kernels and little else, from the first request on (no compile).
//
// Nor do the calls go through tensors: each op's allocations, views and dispatch (~20 a layer) cost 0.3-0.9 us
// warm, but 3-10 us in a step, where every linear's weight has just gone through the caches and taken the
// dispatcher's code and tables with it (a probe: 3 narrow + view 2.5 us warm, 24 us after 6 MB were read). The
// kernels take raw rows (kernels.h) from a workspace this object keeps from step to step: the default model's
// C++ step 0.90-0.91x the time of the tensor form at 1 row, 0.92-0.95x at 5 and 0.94-0.97x at 16 (2-core Xeon,
// AVX-512 and AVX2 builds, cpu_kernels_ab.py), the same bits.
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
#include <cstring>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "activations.h"
#include "bf16.h"
#include "dynamic_for.h"
#include "kernels.h"

namespace {

// The logits' first `vocab` columns of rows of bf16 `stride` values apart, as float32, on the kernels' threads:
// Tensor::to would open an OpenMP region, whose worker then spins for milliseconds on a core the pool's worker needs
// (thread_pool.h).
at::Tensor widen(const uint16_t* in, int64_t rows, int64_t stride, int64_t vocab) {
  constexpr int64_t kPiece = 8192;
  const int64_t pieces = (vocab + kPiece - 1) / kPiece;
  at::Tensor out = at::empty({rows, vocab}, at::kFloat);
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
  at::Tensor bias;  // bf16, as the eager step adds it
  int64_t parts = 2, width = 0;  // width: the outputs of all pieces

  // y [n, width] (bf16) of x [n, depth] (float32 or bf16 rows), as the ops give it: the int4 pieces straight into y on
  // activations quantised once into `act` (each op quantises the same x to the same values), the int8 ones through
  // their op; then the bias added in float32 and rounded, as torch's bf16 add does
  template <typename X>
  void operator()(const X* x, int64_t n, int64_t depth, uint16_t* y, Activations& act) const {
    bool quantised = false;
    int64_t col = 0;
    for (const auto& piece : pieces) {
      const at::Tensor &w = piece.first, &s = piece.second;
      if (w.scalar_type() == at::kByte) {
        if (!quantised) quantize_into(act, x, n, depth, parts == 1), quantised = true;
        k::q4_linear_into(act, n, depth, w.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>()),
                          w.size(0), parts == 1, y + col, width);
        col += 16 * w.size(0);
      } else {
        const auto dtype = std::is_same_v<X, float> ? at::kFloat : at::kBFloat16;
        const at::Tensor out = k::q8_linear(at::from_blob(const_cast<X*>(x), {n, depth}, dtype), w, s, parts);
        const int64_t cols = out.size(1);
        const uint16_t* o = reinterpret_cast<const uint16_t*>(out.data_ptr<at::BFloat16>());
        for (int64_t r = 0; r < n; ++r) std::memcpy(y + r * width + col, o + r * cols, cols * sizeof(uint16_t));
        col += cols;
      }
    }
    if (bias.numel()) {
      const uint16_t* b = reinterpret_cast<const uint16_t*>(bias.data_ptr<at::BFloat16>());
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < width; ++c) y[r * width + c] = bf16_bits(as_float(y[r * width + c]) + as_float(b[c]));
    }
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
        l.width += (a.scalar_type() == at::kByte ? 16 : 8) * a.size(0);  // a tile's outputs: q4_linear's, q8_linear's
      }
      const at::Tensor bias = next();
      l.bias = bias.numel() ? bias.to(at::kBFloat16).contiguous() : bias;
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
    TORCH_CHECK(rows.dim() == 2 && rows.size(0) == 4 && rows.scalar_type() == at::kLong && tables.dim() == 2 &&
                    tables.size(0) == rows.size(1) && tables.scalar_type() == at::kLong,
                "LlamaStep.step: rows [4, n] and tables [n, W], int64");
    const at::Tensor r = rows.contiguous(), t = tables.contiguous(), o = out.to(at::kLong).contiguous();
    std::unique_lock<std::mutex> mine(busy_, std::try_to_lock);  // another thread's step meanwhile: buffers of its own
    if (embed_.scalar_type() == at::kFloat) {
      Workspace<float> local;
      return run<float>(mine.owns_lock() ? work_f32_ : local, r, t, head, o);
    }
    Workspace<uint16_t> local;
    return run<uint16_t>(mine.owns_lock() ? work_bf16_ : local, r, t, head, o);
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
  // A step's buffers, kept from step to step: R the residual stream's dtype (float, or bf16 as uint16_t)
  template <typename R>
  struct Workspace {
    std::vector<R> residual, h, sum;
    std::vector<uint16_t> qkv, q, attn, o, gate_up, act, x, logits;
    std::vector<float> q32, out32;
    Activations quantised;
  };

  // step's body: the eager step's kernels in its order, on the workspace's rows (every row's arithmetic is the ops')
  template <typename R>
  at::Tensor run(Workspace<R>& w, const at::Tensor& rows, const at::Tensor& tables, bool head,
                 const at::Tensor& out) const {
    const int64_t n = rows.size(1), width = tables.size(1), hidden = embed_.size(1), d = head_dim_;
    const int64_t* ids = rows.data_ptr<int64_t>();
    const int64_t *positions = ids + n, *slots = ids + 2 * n, *ctx = ids + 3 * n;
    const int64_t* table = tables.data_ptr<int64_t>();
    const float e = static_cast<float>(eps_);
    auto data = [](const at::Tensor& x) { return reinterpret_cast<const R*>(x.data_ptr()); };
    auto bits = [](const at::Tensor& x) { return reinterpret_cast<uint16_t*>(x.data_ptr()); };
    const int64_t q_width = heads_ * d, qkv_width = layers_.empty() ? 0 : layers_[0].qkv.width;
    const int64_t inner = layers_.empty() ? 0 : layers_[0].gate_up.width / 2;
    w.residual.resize(n * hidden), w.h.resize(n * hidden), w.qkv.resize(n * qkv_width), w.q.resize(n * q_width);
    w.attn.resize(n * q_width), w.o.resize(n * hidden), w.gate_up.resize(n * 2 * inner), w.act.resize(n * inner);
    w.x.resize(n * hidden), w.q32.resize(n * q_width), w.out32.resize(n * q_width);
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < embed_.size(0), "LlamaStep.step: token id ", ids[i], " out of range");
      TORCH_CHECK(positions[i] >= 0 && positions[i] < cos_.size(0), "LlamaStep.step: position ", positions[i],
                  " past the rope tables' ", cos_.size(0));
      std::memcpy(w.residual.data() + i * hidden, data(embed_) + ids[i] * hidden, hidden * sizeof(R));
    }
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      if (i == 0)
        k::rms_norm_rows(w.residual.data(), data(l.input_norm), w.h.data(), n, hidden, e);
      else
        k::add_rms_norm_rows(w.x.data(), w.residual.data(), data(l.input_norm), w.residual.data(), w.h.data(), n,
                             hidden, e);
      l.qkv(w.h.data(), n, hidden, w.qkv.data(), w.quantised);
      k::rope_write_kv_rows(w.qkv.data(), qkv_width, n, heads_, kv_heads_, d, cos_.data_ptr<float>(),
                            sin_.data_ptr<float>(), cos_.stride(0), positions, slots, bits(l.k_cache), bits(l.v_cache),
                            w.q.data());
      k::paged_decode_attention_rows(w.q.data(), n, heads_, d, bits(l.k_cache), bits(l.v_cache), kv_heads_,
                                     l.k_cache.size(1), table, width, ctx, static_cast<float>(scale_), w.q32.data(),
                                     w.out32.data(), w.attn.data());
      l.o(w.attn.data(), n, q_width, w.o.data(), w.quantised);
      k::add_rms_norm_rows(w.o.data(), w.residual.data(), data(l.post_norm), w.residual.data(), w.h.data(), n, hidden, e);
      l.gate_up(w.h.data(), n, hidden, w.gate_up.data(), w.quantised);
      k::swiglu_rows(w.gate_up.data(), 2 * inner, n, inner, w.act.data());
      l.down(w.act.data(), n, inner, w.x.data(), w.quantised);
    }
    // the final norm (and the head) for the rows asked for: out's (each may be asked for more than once), or all
    const int64_t m = out.numel() > 0 && out.numel() < n ? out.numel() : n;
    if (m == n) {
      k::add_rms_norm_rows(w.x.data(), w.residual.data(), data(norm_), w.residual.data(), w.h.data(), n, hidden, e);
    } else {
      const int64_t* pick = out.data_ptr<int64_t>();
      w.sum.resize(hidden);
      for (int64_t j = 0; j < m; ++j) {
        const int64_t i = pick[j];
        TORCH_CHECK(i >= 0 && i < n, "LlamaStep.step: a row to keep, ", i, ", is not one of the step's ", n);
        k::add_rms_norm_rows(w.x.data() + i * hidden, w.residual.data() + i * hidden, data(norm_), w.sum.data(),
                             w.h.data() + j * hidden, 1, hidden, e);
      }
    }
    if (!head) {
      at::Tensor h = at::empty({m, hidden}, embed_.options());
      std::memcpy(h.data_ptr(), w.h.data(), m * hidden * sizeof(R));
      return h;
    }
    w.logits.resize(m * head_.width);
    head_(w.h.data(), m, hidden, w.logits.data(), w.quantised);
    return widen(w.logits.data(), m, head_.width, vocab_);
  }

  mutable std::mutex busy_;  // held by the step that uses the workspaces
  mutable Workspace<float> work_f32_;
  mutable Workspace<uint16_t> work_bf16_;
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
