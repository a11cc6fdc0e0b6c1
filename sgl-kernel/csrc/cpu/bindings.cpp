// Python bindings of the CPU kernels (module sgl_kernel._cpu).
#include <torch/extension.h>

void decode_attention(
    const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, at::Tensor& out,
    const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
    double scale);

at::Tensor linear_f16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "radixserve CPU kernels";
  m.def("decode_attention", &decode_attention,
        "Paged decode attention over the token pool, in place (q/out [bs,H,D] fp32)");
  m.def("linear_f16", &linear_f16, "y = x @ w.T (+ bias): x fp32 [M,K], w fp16 [N,K], fp32 math",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("linear_f32", &linear_f32, "y = x @ w.T (+ bias) for small M: x, w fp32",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
}
