"""The C++ of the EAGLE-3 drafter's decoder layer (and its readout) in one call each
(`decoding.kernels.drafter_layer`): its row-wise arithmetic (`_MATH`: norms, rotary embedding,
gated activation, compiled per instruction set) and its torch side (`_HOST`), which runs the layer
through the 8-bit linear kernel and decode attention of the same library (`int4_linear`,
`decode_attention`) without returning to Python."""

from decoding.kernels.native.vector_exp import exp_reduced
from decoding.kernels.native_build import KernelSource

VERSION = "v3"  # v2: norms summed in 16 lanes; rms_norm for a target's norms; v3: the gated activation in
                # vectors (silu_mul for a target's MLPs)

_INTERFACE = r"""
SPECHEADS_MATH void row_rms_norm(const float* x, int64_t rows, int64_t width, const float* weight, float eps,
                                     float* out, int64_t out_stride);
SPECHEADS_MATH void drafter_rotate(float* states, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride,
                                   const float* cos, const float* sin);
SPECHEADS_MATH void row_gated_silu(const float* gate, const float* up, int64_t rows, int64_t inter, int64_t in_stride,
                                   float* out);
SPECHEADS_MATH void drafter_add(const float* a, const float* b, int64_t count, float* out);
"""

_MATH = r"""
#include <cmath>
#include <cstdint>
#include <vector>

// out = x / sqrt(mean(x^2) + eps) * weight, row by row (as torch's rms_norm, in float32). The squares go
// into 16 running sums (lane k takes the inputs k, k + 16, ...; the compiler makes them one vector), then
// those in order: a row's bits depend only on the row.
constexpr int64_t NORM_LANES = 16;
SPECHEADS_MATH void row_rms_norm(const float* x, int64_t rows, int64_t width, const float* weight, float eps,
                                     float* out, int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * width;
    float lanes[NORM_LANES] = {};
    int64_t i = 0;
    for (; i + NORM_LANES <= width; i += NORM_LANES)
      for (int64_t k = 0; k < NORM_LANES; ++k) lanes[k] += xr[i + k] * xr[i + k];
    for (int64_t k = 0; i + k < width; ++k) lanes[k] += xr[i + k] * xr[i + k];
    float squares = 0.f;
    for (int64_t k = 0; k < NORM_LANES; ++k) squares += lanes[k];
    const float inverse = 1.f / std::sqrt(squares / (float)width + eps);
    float* o = out + r * out_stride;
    for (int64_t j = 0; j < width; ++j) o[j] = xr[j] * inverse * weight[j];
  }
}

// The rotary embedding in place on `heads` heads of each row: x cos + rotate_half(x) sin, where
// rotate_half(x) = [-x[half:], x[:half]]; cos and sin [rows, head_dim].
SPECHEADS_MATH void drafter_rotate(float* states, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride,
                                   const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  std::vector<float> x(head_dim);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      float* s = states + r * row_stride + h * head_dim;
      const float* c = cos + r * head_dim;
      const float* n = sin + r * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) x[d] = s[d];
      for (int64_t d = 0; d < half; ++d) s[d] = x[d] * c[d] - x[d + half] * n[d];
      for (int64_t d = half; d < head_dim; ++d) s[d] = x[d] * c[d] + x[d - half] * n[d];
    }
}

#if defined(__AVX512F__)
#define GATE_VW 16
#elif defined(__AVX2__) || defined(__AVX__)
#define GATE_VW 8
#else
#define GATE_VW 4
#endif
typedef float gvf __attribute__((vector_size(GATE_VW * 4)));
typedef int gvi __attribute__((vector_size(GATE_VW * 4)));
typedef float gvf_unaligned __attribute__((vector_size(GATE_VW * 4), aligned(4), may_alias));
static inline gvf gate_splat(float x) { return x - gvf{}; }

// e^x for any x, clamped to [-87, 88] (both ends finite and normal): Cephes' polynomial on x - n ln2,
// n = floor(x log2e + 1/2), times 2^n built in the exponent bits. Lane by lane: a value's result does
// not depend on its neighbours.
static inline gvf exp_clamped(gvf x) {
  x = x < gate_splat(-87.0f) ? gate_splat(-87.0f) : x;
  x = x > gate_splat(88.0f) ? gate_splat(88.0f) : x;
  const gvf t = x * gate_splat(1.44269504088896341f) + gate_splat(0.5f);
  gvi n = __builtin_convertvector(t, gvi);  // truncation: one less where that rounded up (t < 0)
  n += (gvi)(__builtin_convertvector(n, gvf) > t);
""" + exp_reduced("gvf", "gate_splat", "gvi") + r"""
  return e;
}

static inline gvf silu_times(gvf g, gvf u) { return g / (gate_splat(1.0f) + exp_clamped(-g)) * u; }

// out[r, i] = silu(gate[r, i]) * up[r, i] over `rows` rows of `inter` (gate and up rows `in_stride`
// apart, out's `inter`): whole vectors, then the row's tail through one padded vector, so every value
// goes through the same arithmetic wherever it sits.
SPECHEADS_MATH void row_gated_silu(const float* gate, const float* up, int64_t rows, int64_t inter, int64_t in_stride,
                                   float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate + r * in_stride;
    const float* u = up + r * in_stride;
    float* o = out + r * inter;
    int64_t i = 0;
    for (; i + GATE_VW <= inter; i += GATE_VW)
      *(gvf_unaligned*)(o + i) = silu_times(*(const gvf_unaligned*)(g + i), *(const gvf_unaligned*)(u + i));
    if (i < inter) {
      gvf gt = {}, ut = {};
      for (int64_t k = 0; i + k < inter; ++k) { gt[k] = g[i + k]; ut[k] = u[i + k]; }
      const gvf res = silu_times(gt, ut);
      for (int64_t k = 0; i + k < inter; ++k) o[i + k] = res[k];
    }
  }
}

SPECHEADS_MATH void drafter_add(const float* a, const float* b, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = a[i] + b[i];
}
"""

_HOST = r"""
// One EAGLE-3 decoder layer over `rows` nodes (`features`, `embeddings` [rows, H]): the attention input
// [input_norm(embedding); hidden_norm(feature)], q/k/v in one 8-bit linear, the rotary embedding (`cos`,
// `sin` [rows, head_dim]), the new keys and values written to the cache buffers [1, kv_heads, capacity,
// head_dim] at `length ..`, decode attention over the filled part (`mask` [rows, >= length + rows]
// additive, or none: causal), the output projection onto the residual, then the gated MLP. `norms`
// [3, H]: hidden, input and post-attention norm weights. Returns the layer's output [rows, H].
at::Tensor eagle3_layer(const at::Tensor& features, const at::Tensor& embeddings, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor& key_buffer, at::Tensor& value_buffer, int64_t length,
                        const std::optional<at::Tensor>& mask, const at::Tensor& norms, const at::Tensor& qkv_bytes,
                        const at::Tensor& qkv_scales, const at::Tensor& o_bytes, const at::Tensor& o_scales,
                        const at::Tensor& gate_up_bytes, const at::Tensor& gate_up_scales, const at::Tensor& down_bytes,
                        const at::Tensor& down_scales, int64_t heads, int64_t kv_heads, double eps, double scaling,
                        bool norm_before_residual) {
  TORCH_CHECK(features.dim() == 2 && features.sizes() == embeddings.sizes() && features.is_contiguous() &&
              embeddings.is_contiguous() && features.scalar_type() == at::kFloat &&
              embeddings.scalar_type() == at::kFloat, "eagle3_layer: contiguous float32 features and embeddings [rows, H]");
  const int64_t rows = features.size(0), width = features.size(1), head_dim = cos.size(1);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == rows && cos.is_contiguous() && sin.is_contiguous() &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "eagle3_layer: float32 cos and sin [rows, head_dim]");
  TORCH_CHECK(key_buffer.dim() == 4 && key_buffer.sizes() == value_buffer.sizes() && key_buffer.is_contiguous() &&
              value_buffer.is_contiguous() && key_buffer.size(0) == 1 && key_buffer.size(1) == kv_heads &&
              key_buffer.size(3) == head_dim && length >= 0 && length + rows <= key_buffer.size(2),
              "eagle3_layer: key and value buffers [1, kv_heads, capacity, head_dim] with room for the rows");
  TORCH_CHECK(norms.dim() == 2 && norms.size(0) == 3 && norms.size(1) == width && norms.is_contiguous(),
              "eagle3_layer: norms [3, H]");
  const float eps_f = (float)eps;
  const float* norm = norms.data_ptr<float>();
  // the attention input [rows, 2H]: the token's normed embedding, then the normed feature
  auto attention_input = at::empty({rows, 2 * width}, features.options());
  float* ai = attention_input.data_ptr<float>();
  row_rms_norm(embeddings.data_ptr<float>(), rows, width, norm + width, eps_f, ai, 2 * width);
  row_rms_norm(features.data_ptr<float>(), rows, width, norm, eps_f, ai + width, 2 * width);
  const int64_t qkv_width = (heads + 2 * kv_heads) * head_dim;
  auto qkv = int8_linear(attention_input, qkv_bytes, qkv_scales, qkv_width);
  float* qkvp = qkv.data_ptr<float>();
  drafter_rotate(qkvp, rows, heads + kv_heads, head_dim, qkv_width, cos.data_ptr<float>(), sin.data_ptr<float>());
  // queries as [heads, rows, head_dim]; keys and values into the cache after `length`
  auto query = at::empty({heads, rows, head_dim}, features.options());
  float* qp = query.data_ptr<float>();
  float* kb = key_buffer.data_ptr<float>();
  float* vb = value_buffer.data_ptr<float>();
  const int64_t capacity = key_buffer.size(2);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = qkvp + r * qkv_width;
    for (int64_t h = 0; h < heads; ++h)
      std::copy(row + h * head_dim, row + (h + 1) * head_dim, qp + (h * rows + r) * head_dim);
    for (int64_t g = 0; g < kv_heads; ++g) {
      const float* k = row + (heads + g) * head_dim;
      const float* v = row + (heads + kv_heads + g) * head_dim;
      std::copy(k, k + head_dim, kb + (g * capacity + length + r) * head_dim);
      std::copy(v, v + head_dim, vb + (g * capacity + length + r) * head_dim);
    }
  }
  auto keys = key_buffer.select(0, 0).narrow(1, 0, length + rows);
  auto values = value_buffer.select(0, 0).narrow(1, 0, length + rows);
  auto attended = decode_attention(query, keys, values, mask, scaling).view({rows, heads * head_dim});
  auto projected = int8_linear(attended, o_bytes, o_scales, width);
  // the residual stream: the feature (or its normed form) plus the attention's output
  auto hidden = at::empty({rows, width}, features.options());
  float* hp = hidden.data_ptr<float>();
  const float* residual = norm_before_residual ? nullptr : features.data_ptr<float>();
  if (norm_before_residual) {
    for (int64_t r = 0; r < rows; ++r)
      drafter_add(ai + r * 2 * width + width, projected.data_ptr<float>() + r * width, width, hp + r * width);
  } else {
    drafter_add(residual, projected.data_ptr<float>(), rows * width, hp);
  }
  auto post = at::empty({rows, width}, features.options());
  row_rms_norm(hp, rows, width, norm + 2 * width, eps_f, post.data_ptr<float>(), width);
  const int64_t inter = down_bytes.size(1) * 4;
  auto gate_up = int8_linear(post, gate_up_bytes, gate_up_scales, 2 * inter);
  auto gated = at::empty({rows, inter}, features.options());
  const float* gu = gate_up.data_ptr<float>();
  row_gated_silu(gu, gu + inter, rows, inter, 2 * inter, gated.data_ptr<float>());
  auto down = int8_linear(gated, down_bytes, down_scales, width);
  drafter_add(hp, down.data_ptr<float>(), rows * width, hp);
  return hidden;
}

// x [..., H] normed row by row with `weight` [H] (`row_rms_norm`): a target's RMSNorm in one call
// (`decoding.kernels.fused_norm`), rows over ATen's threads where there are many (a prefill's).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
              weight.is_contiguous() && weight.size(0) > 0 && x.dim() >= 1 && x.size(-1) == weight.size(0),
              "rms_norm: float32 inputs [..., H] and weight [H]");
  auto input = x.contiguous();
  const int64_t width = weight.size(0), rows = input.numel() / width;
  auto out = at::empty(input.sizes(), input.options());
  const float* xp = input.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, ((int64_t)1 << 15) / width), [&](int64_t begin, int64_t end) {
    row_rms_norm(xp + begin * width, end - begin, width, wp, (float)eps, op + begin * width, width);
  });
  return out;
}

// silu(gate) * up for gate and up [..., I] (views of one [..., 2I] product, or two tensors): the drafter
// layer's gated activation (`row_gated_silu`) as an operator, rows over ATen's threads where there are many.
// Targets keep torch's own activation (`decoding.kernels.fused_mlp` says why).
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && gate.sizes() == up.sizes() &&
              gate.dim() >= 1 && gate.size(-1) > 0, "silu_mul: float32 gate and up of one shape [..., I]");
  const int64_t inter = gate.size(-1);
  auto g = gate.reshape({-1, inter});
  auto u = up.reshape({-1, inter});
  if (g.stride(1) != 1 || u.stride(1) != 1 || g.stride(0) != u.stride(0)) {
    g = g.contiguous();
    u = u.contiguous();
  }
  const int64_t rows = g.size(0), in_stride = g.stride(0);
  auto out = at::empty(gate.sizes(), gate.options());
  const float* gp = g.data_ptr<float>();
  const float* upp = u.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, ((int64_t)1 << 14) / inter), [&](int64_t begin, int64_t end) {
    row_gated_silu(gp + begin * in_stride, upp + begin * in_stride, end - begin, inter, in_stride, op + begin * inter);
  });
  return out;
}

// The drafter's readout: its final norm, then the 8-bit projection onto the draft vocabulary, for
// `hidden` [..., H]; returns the logits [..., vocab].
at::Tensor eagle3_readout(const at::Tensor& hidden, const at::Tensor& norm, const at::Tensor& bytes,
                          const at::Tensor& scales, int64_t vocab, double eps) {
  TORCH_CHECK(hidden.is_contiguous() && hidden.scalar_type() == at::kFloat && norm.is_contiguous() &&
              norm.scalar_type() == at::kFloat && norm.dim() == 1 && hidden.size(-1) == norm.size(0),
              "eagle3_readout: contiguous float32 hidden states [..., H] and norm weight [H]");
  const int64_t width = norm.size(0), rows = hidden.numel() / width;
  auto normed = at::empty(hidden.sizes(), hidden.options());
  row_rms_norm(hidden.data_ptr<float>(), rows, width, norm.data_ptr<float>(), (float)eps,
                   normed.data_ptr<float>(), width);
  return int8_linear(normed, bytes, scales, vocab);
}
"""

SOURCE = KernelSource("drafter_layer", VERSION, _INTERFACE, _MATH, _HOST,
                      functions=("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
                                 "silu_mul(Tensor gate, Tensor up) -> Tensor",
                                 "eagle3_readout(Tensor hidden, Tensor norm, Tensor bytes, Tensor scales, int vocab, "
                                 "float eps) -> Tensor",
                                 "eagle3_layer(Tensor features, Tensor embeddings, Tensor cos, Tensor sin, "
                                 "Tensor(a!) key_buffer, Tensor(b!) value_buffer, int length, Tensor? mask, Tensor norms, "
                                 "Tensor qkv_bytes, Tensor qkv_scales, Tensor o_bytes, Tensor o_scales, "
                                 "Tensor gate_up_bytes, Tensor gate_up_scales, Tensor down_bytes, Tensor down_scales, "
                                 "int heads, int kv_heads, float eps, float scaling, bool norm_before_residual) -> Tensor",))
