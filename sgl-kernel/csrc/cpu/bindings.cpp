// Python bindings of the CPU kernels (module sgl_kernel._cpu).
#include <torch/extension.h>

#include "common.h"
#include "decode_model.h"
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "radixserve CPU kernels";
  m.def("decode_attention", &decode_attention,
        "Paged decode attention over the token pool, in place (q/out [bs,H,D] fp32)");
  m.def("extend_attention", &extend_attention,
        "Paged causal extend (prefill) attention over the token pool (q [T,H,D], out [T,H*D] fp32)");
  // Which vector path extend_attention was compiled with ("none": it raises, use torch).
  m.attr("extend_attention_isa") = RS_HAVE_AVX512 ? "avx512" : RS_HAVE_AVX2 ? "avx2" : "none";
  m.def("linear_f16", &linear_f16, "y = x @ w.T (+ bias): x fp32 [M,K], w fp16 [N,K], fp32 math",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("linear_f32", &linear_f32, "y = x @ w.T (+ bias) for small M: x, w fp32",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("rmsnorm", &rmsnorm, "RMSNorm of each row: x [M,N] fp32, w [N]");
  m.def("fused_add_rmsnorm_", &fused_add_rmsnorm_, "In place: residual += x; x = rmsnorm(residual)");
  m.def("rotary_neox_", &rotary_neox_, "Neox rotary in place on q [T,H,D] and k [T,Hkv,D]");
  m.def("silu_and_mul", &silu_and_mul, "x [M, 2d] -> silu(x[:, :d]) * x[:, d:]");
  m.def("store_kv", &store_kv, "k_buf[loc] = k; v_buf[loc] = v (fp32 pools)");
  py::class_<DecodeModel>(m, "DecodeModel", "A Llama-family decoder stack run by one call per decode step")
      .def(py::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("rms_norm_eps"), py::arg("scaling"),
           py::arg("cos"), py::arg("sin"))
      .def("add_layer", &DecodeModel::add_layer)
      .def("set_final_norm", &DecodeModel::set_final_norm)
      .def("forward", &DecodeModel::forward, py::arg("hidden"), py::arg("positions"), py::arg("out_cache_loc"),
           py::arg("req_to_token"), py::arg("req_pool_indices"), py::arg("seq_lens"));
}
