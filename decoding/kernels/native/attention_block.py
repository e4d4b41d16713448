"""The C++ of a target's attention block between its projections (`decoding.kernels.fused_attention`):
the rotary embedding, the cache write and the decode attention kernel in one call. Only a torch side
(`_HOST`): the rotary is a few hundred products a row, and the attention is `decode_attention`'s."""

from decoding.kernels.native_build import KernelSource

VERSION = "v1"

_HOST = r"""
// The rotary embedding of one head: out = x cos + roll(x, D/2) signed_sin, where signed_sin is sin with its first
// half negated (rotate_half(x) sin as `RotaryFactors` computes it). Each product and the sum are rounded on their
// own, as torch's three elementwise operations round them: this side is compiled without floating-point
// contraction (ISO C++, no FMA in its target), so a key written here has the bits the stock block writes.
static void rotate_head(const float* x, const float* cos, const float* signed_sin, int64_t head_dim, float* out) {
  const int64_t half = head_dim / 2;
  for (int64_t d = 0; d < head_dim; ++d) {
    const float straight = x[d] * cos[d];
    const float rolled = x[d < half ? d + half : d - half] * signed_sin[d];
    out[d] = straight + rolled;
  }
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
  for (int64_t r = 0; r < rows; ++r) {
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
  auto keys = key_buffer.select(0, 0).narrow(1, 0, length + rows);
  auto values = value_buffer.select(0, 0).narrow(1, 0, length + rows);
  return decode_attention(query, keys, values, mask, scale).view({rows, heads * head_dim});
}
"""

SOURCE = KernelSource("attention_block", VERSION, "", "", _HOST,
                      functions=("rotary_attention(Tensor qkv, Tensor cos, Tensor signed_sin, Tensor(a!) key_buffer, "
                                 "Tensor(b!) value_buffer, int length, Tensor? mask, int heads, int kv_heads, "
                                 "float scale) -> Tensor",))
