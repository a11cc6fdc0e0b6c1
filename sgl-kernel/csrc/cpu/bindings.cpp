// Python bindings of the CPU kernels (module sgl_kernel._cpu).
#include <torch/extension.h>

void decode_attention(
    const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, at::Tensor& out,
    const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
    double scale);

at::Tensor linear_f16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);

at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& w, double eps);
void fused_add_rmsnorm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps);
void rotary_neox_(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& cos,
                  const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);
void store_kv(at::Tensor& k_buf, at::Tensor& v_buf, const at::Tensor& loc, const at::Tensor& k, const at::Tensor& v);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "radixserve CPU kernels";
  m.def("decode_attention", &decode_attention,
        "Paged decode attention over the token pool, in place (q/out [bs,H,D] fp32)");
  m.def("linear_f16", &linear_f16, "y = x @ w.T (+ bias): x fp32 [M,K], w fp16 [N,K], fp32 math",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("linear_f32", &linear_f32, "y = x @ w.T (+ bias) for small M: x, w fp32",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("rmsnorm", &rmsnorm, "RMSNorm of each row: x [M,N] fp32, w [N]");
  m.def("fused_add_rmsnorm_", &fused_add_rmsnorm_, "In place: residual += x; x = rmsnorm(residual)");
  m.def("rotary_neox_", &rotary_neox_, "Neox rotary in place on q [T,H,D] and k [T,Hkv,D]");
  m.def("silu_and_mul", &silu_and_mul, "x [M, 2d] -> silu(x[:, :d]) * x[:, d:]");
  m.def("store_kv", &store_kv, "k_buf[loc] = k; v_buf[loc] = v (fp32 pools)");
}
