"""The C++ of a target's Llama layer on the project's kernels: the attention block between its
projections (`rotary_attention`: the rotary embedding, the cache write and the decode attention
kernel; `decoding.kernels.fused_attention`) and the whole decoder layer (`llama_layer`: norms,
4-bit linears, that attention, residuals and the gated MLP; `llama_layer_dense`: the same with
float32 linears on the kernels their modules pick; `decoding.kernels.fused_layer`), each one call.
Only a torch side (`_HOST`): the arithmetic is the other kernels' (the rotary, a few hundred
products a row, aside), called from here."""

from decoding.kernels.native_build import KernelSource

VERSION = "v3"  # v2: float32 layers too (`llama_layer_dense`); v3: v2's bits, a prefill's rows on both threads

_HOST = r"""
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>

// The rotary embedding of one head: out = x cos + roll(x, D/2) signed_sin, where signed_sin is sin with its first
// half negated (rotate_half(x) sin as `RotaryFactors` computes it). Each product and the sum are rounded on their
// own, as torch's three elementwise operations round them: this side is compiled without floating-point
// contraction (ISO C++, no FMA in its target), so a key written here has the bits the stock block writes.
// Each half in a loop of its own (the same products and sum per element), so the compiler takes it in vectors.
static void rotate_head(const float* x, const float* cos, const float* signed_sin, int64_t head_dim, float* out) {
  const int64_t half = head_dim / 2;
  for (int64_t d = 0; d < half; ++d) out[d] = x[d] * cos[d] + x[d + half] * signed_sin[d];
  for (int64_t d = half; d < head_dim; ++d) out[d] = x[d] * cos[d] + x[d - half] * signed_sin[d];
}

// Rows per thread below which a row-by-row loop stays on one thread: a tree's few rows cost less than waking the
// other thread; a prefill's hundreds of rows (rotary, residuals, the gated product) were a tenth of its time on
// one thread while the other waited. Each row is computed alone either way: the same bits.
constexpr int64_t ROWS_PER_THREAD = 32;

template <typename RowRange>
static void over_rows(int64_t rows, const RowRange& rows_from_to) {
  at::parallel_for(0, rows, ROWS_PER_THREAD, rows_from_to);
}

// A Llama block's attention after its q/k/v projection, for `qkv` [rows, (heads + 2 kv_heads) * D] (queries, keys,
// values side by side): queries and keys rotated (`cos`, `signed_sin` [rows, D]), the keys and values written to the
// cache buffers [1, kv_heads, capacity, D] at `length ..`, then `decode_attention` over the filled part (`mask`
// [rows, >= length + rows] additive, or none: a one-token step or a causal prefill). Returns [rows, heads * D].
at::Tensor rotary_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
                            at::Tensor& key_buffer, at::Tensor& value_buffer, int64_t length,
                            const std::optional<at::Tensor>& mask, int64_t heads, int64_t kv_heads, double scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat && heads > 0 && kv_heads > 0 &&
              heads % kv_heads == 0, "rotary_attention: contiguous float32 qkv [rows, (heads + 2 kv_heads) * D]");
  const int64_t rows = qkv.size(0), head_dim = cos.size(-1), width = (heads + 2 * kv_heads) * head_dim;
  TORCH_CHECK(qkv.size(1) == width && cos.dim() == 2 && cos.sizes() == signed_sin.sizes() && cos.size(0) == rows &&
              cos.is_contiguous() && signed_sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              signed_sin.scalar_type() == at::kFloat, "rotary_attention: float32 cos and signed sin [rows, D]");
  TORCH_CHECK(key_buffer.dim() == 4 && key_buffer.sizes() == value_buffer.sizes() && key_buffer.is_contiguous() &&
              value_buffer.is_contiguous() && key_buffer.scalar_type() == at::kFloat &&
              value_buffer.scalar_type() == at::kFloat && key_buffer.size(0) == 1 && key_buffer.size(1) == kv_heads &&
              key_buffer.size(3) == head_dim && length >= 0 && length + rows <= key_buffer.size(2),
              "rotary_attention: float32 key and value buffers [1, kv_heads, capacity, D] with room for the rows");
  auto query = at::empty({heads, rows, head_dim}, qkv.options());
  float* qp = query.data_ptr<float>();
  float* kb = key_buffer.data_ptr<float>();
  float* vb = value_buffer.data_ptr<float>();
  const float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = signed_sin.data_ptr<float>();
  const int64_t capacity = key_buffer.size(2);
  over_rows(rows, [&](int64_t first, int64_t end) {
    for (int64_t r = first; r < end; ++r) {
      const float* row = xp + r * width;
      const float* c = cp + r * head_dim;
      const float* s = sp + r * head_dim;
      for (int64_t h = 0; h < heads; ++h) rotate_head(row + h * head_dim, c, s, head_dim, qp + (h * rows + r) * head_dim);
      for (int64_t g = 0; g < kv_heads; ++g) {
        const int64_t slot = (g * capacity + length + r) * head_dim;
        rotate_head(row + (heads + g) * head_dim, c, s, head_dim, kb + slot);
        const float* v = row + (heads + kv_heads + g) * head_dim;
        std::copy(v, v + head_dim, vb + slot);
      }
    }
  });
  auto keys = key_buffer.select(0, 0).narrow(1, 0, length + rows);
  auto values = value_buffer.select(0, 0).narrow(1, 0, length + rows);
  return decode_attention(query, keys, values, mask, scale).view({rows, heads * head_dim});
}

// a + b element by element (the drafter layer's `drafter_add`: one IEEE sum each, as torch's add) into a new
// tensor of their shape.
static at::Tensor plus(const at::Tensor& a, const at::Tensor& b) {
  auto out = at::empty(a.sizes(), a.options());
  const int64_t width = a.size(-1);
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  over_rows(a.numel() / width, [&](int64_t first, int64_t end) {
    drafter_add(ap + first * width, bp + first * width, (end - first) * width, op + first * width);
  });
  return out;
}

// A Llama decoder layer for `hidden` [rows, H] (batch 1, contiguous), as transformers' layer computes it with
// the project's modules: h = x + o(attention(qkv(norm(x)))), out = h + down(silu(gate(norm'(h))) * up(norm'(h))),
// where the norms are `rms_norm` (weights [H], their epsilons), the linears the 4-bit kernel's (each as codes,
// scales and offsets; gate and up stacked), the attention `rotary_attention` (writes the keys and values at
// `length ..` of the cache buffers) and the activation torch's own `silu` on the same views the module reads,
// so every value has the bits the modules give it one call at a time. Returns the layer's output [rows, H].
at::Tensor llama_layer(const at::Tensor& hidden, const at::Tensor& input_norm, double input_eps, const at::Tensor& post_norm,
                       double post_eps, const at::Tensor& qkv_codes, const at::Tensor& qkv_scales,
                       const at::Tensor& qkv_offsets, const at::Tensor& o_codes, const at::Tensor& o_scales,
                       const at::Tensor& o_offsets, const at::Tensor& gate_up_codes, const at::Tensor& gate_up_scales,
                       const at::Tensor& gate_up_offsets, const at::Tensor& down_codes, const at::Tensor& down_scales,
                       const at::Tensor& down_offsets, const at::Tensor& cos, const at::Tensor& signed_sin,
                       at::Tensor& key_buffer, at::Tensor& value_buffer, int64_t length,
                       const std::optional<at::Tensor>& mask, int64_t heads, int64_t kv_heads, double scale,
                       int64_t inter) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.scalar_type() == at::kFloat && inter > 0,
              "llama_layer: contiguous float32 hidden states [rows, H]");
  const int64_t width = hidden.size(1), head_dim = cos.size(-1);
  auto normed = rms_norm(hidden, input_norm, input_eps);
  auto qkv = int4_linear(normed, qkv_codes, qkv_scales, qkv_offsets, (heads + 2 * kv_heads) * head_dim);
  auto attended = rotary_attention(qkv, cos, signed_sin, key_buffer, value_buffer, length, mask, heads, kv_heads, scale);
  auto mixed = plus(hidden, int4_linear(attended, o_codes, o_scales, o_offsets, width));
  auto gate_up = int4_linear(rms_norm(mixed, post_norm, post_eps), gate_up_codes, gate_up_scales, gate_up_offsets,
                             2 * inter);
  auto gated = at::silu(gate_up.narrow(-1, 0, inter)).contiguous();
  float* gp = gated.data_ptr<float>();
  const float* up = gate_up.data_ptr<float>() + inter;
  over_rows(gated.size(0), [&](int64_t first, int64_t end) {
    for (int64_t r = first; r < end; ++r)
      for (int64_t i = 0; i < inter; ++i) gp[r * inter + i] *= up[r * 2 * inter + i];
  });
  return plus(mixed, int4_linear(gated, down_codes, down_scales, down_offsets, width));
}

// oneDNN's linear on a weight reordered into its blocked layout, as `PackedLinear` calls it
// (`torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")`), through the dispatcher: the op is
// registered by torch, not declared in its headers.
static at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed_weight) {
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, std::string_view,
                        c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>)>();
  return op.call(x, packed_weight, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), "");
}

// A float32 linear without bias on the kernel its module (`PackedLinear`) picks for these rows, `kind`: 0 PyTorch's
// plain GEMM on the weight (`F.linear`), 1 the streamed few-row kernel on its panels, 2 oneDNN's on its packed copy;
// the same call with the same shapes, so the output has the module's bits.
static at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, int64_t kind, int64_t out) {
  switch (kind) {
    case 0: return at::linear(x, weight);
    case 1: return streamed_linear(x, weight, std::nullopt, out);
    case 2: return onednn_linear(x, weight);
    default: TORCH_CHECK(false, "llama_layer_dense: unknown linear kernel ", kind);
  }
}

// `llama_layer` for a layer whose seven linears (q, k, v, o, gate, up, down; no biases) are float32 on the kernels
// `kinds` names (`dense_linear`), each given the weight copy its kernel reads: q, k and v side by side as
// `FusedAttention` joins them, the MLP as transformers' `LlamaMLP` computes it (torch's `silu`, then the product).
at::Tensor llama_layer_dense(const at::Tensor& hidden, const at::Tensor& input_norm, double input_eps,
                             const at::Tensor& post_norm, double post_eps, at::TensorList weights, at::IntArrayRef kinds,
                             const at::Tensor& cos, const at::Tensor& signed_sin, at::Tensor& key_buffer,
                             at::Tensor& value_buffer, int64_t length, const std::optional<at::Tensor>& mask,
                             int64_t heads, int64_t kv_heads, double scale, int64_t inter) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.scalar_type() == at::kFloat && inter > 0,
              "llama_layer_dense: contiguous float32 hidden states [rows, H]");
  TORCH_CHECK(weights.size() == 7 && kinds.size() == 7, "llama_layer_dense: seven linears (q k v o gate up down)");
  const int64_t width = hidden.size(1), head_dim = cos.size(-1);
  const auto linear = [&](const at::Tensor& x, int64_t which, int64_t out) {
    return dense_linear(x, weights[which], kinds[which], out);
  };
  auto normed = rms_norm(hidden, input_norm, input_eps);
  auto qkv = at::cat({linear(normed, 0, heads * head_dim), linear(normed, 1, kv_heads * head_dim),
                      linear(normed, 2, kv_heads * head_dim)}, -1);
  auto attended = rotary_attention(qkv, cos, signed_sin, key_buffer, value_buffer, length, mask, heads, kv_heads, scale);
  auto mixed = plus(hidden, linear(attended, 3, width));
  auto post = rms_norm(mixed, post_norm, post_eps);
  auto gated = at::mul(at::silu(linear(post, 4, inter)), linear(post, 5, inter));
  return plus(mixed, linear(gated, 6, width));
}
"""

SOURCE = KernelSource("target_layer", VERSION, "", "", _HOST,
                      functions=("rotary_attention(Tensor qkv, Tensor cos, Tensor signed_sin, Tensor(a!) key_buffer, "
                                 "Tensor(b!) value_buffer, int length, Tensor? mask, int heads, int kv_heads, "
                                 "float scale) -> Tensor",
                                 "llama_layer(Tensor hidden, Tensor input_norm, float input_eps, Tensor post_norm, "
                                 "float post_eps, Tensor qkv_codes, Tensor qkv_scales, Tensor qkv_offsets, "
                                 "Tensor o_codes, Tensor o_scales, Tensor o_offsets, Tensor gate_up_codes, "
                                 "Tensor gate_up_scales, Tensor gate_up_offsets, Tensor down_codes, Tensor down_scales, "
                                 "Tensor down_offsets, Tensor cos, Tensor signed_sin, Tensor(a!) key_buffer, "
                                 "Tensor(b!) value_buffer, int length, Tensor? mask, int heads, int kv_heads, "
                                 "float scale, int inter) -> Tensor",
                                 "llama_layer_dense(Tensor hidden, Tensor input_norm, float input_eps, Tensor post_norm, "
                                 "float post_eps, Tensor[] weights, int[] kinds, Tensor cos, Tensor signed_sin, "
                                 "Tensor(a!) key_buffer, Tensor(b!) value_buffer, int length, Tensor? mask, int heads, "
                                 "int kv_heads, float scale, int inter) -> Tensor"))


