// The one file that speaks torch: checks tensors (and Python buffers, for the
// checksum), adapts them to the plain C++ kernel interface (adam_kernels.h) and
// releases the GIL while kernels run.
// Errors raised here are ValueError/TypeError with the tensor's position; the
// Python classes check earlier and name the parameter.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "adam_kernels.h"
#include "thread_pool.h"

namespace oa = offload_adam;
namespace py = pybind11;

namespace {

using TensorList = std::vector<at::Tensor>;

[[noreturn]] void fail_type(const std::string& msg) { throw py::type_error("offload_adam: " + msg); }
[[noreturn]] void fail_value(const std::string& msg) { throw py::value_error("offload_adam: " + msg); }

std::string where(const char* list, size_t i) { return std::string(list) + "[" + std::to_string(i) + "]"; }

void check_cpu_contiguous(const at::Tensor& t, const char* list, size_t i) {
  if (!t.device().is_cpu()) fail_value(where(list, i) + " must be a CPU tensor, got " + t.device().str());
  if (!t.is_contiguous()) fail_value(where(list, i) + " must be contiguous");
}

void check_numel(const at::Tensor& t, const char* list, size_t i, int64_t numel) {
  if (t.numel() != numel)
    fail_value(where(list, i) + " has " + std::to_string(t.numel()) + " elements, its param has " +
               std::to_string(numel));
}

void check_float32(const TensorList& ts, const char* list) {
  for (size_t i = 0; i < ts.size(); ++i) {
    check_cpu_contiguous(ts[i], list, i);
    if (ts[i].scalar_type() != at::kFloat)
      fail_type(where(list, i) + " must be float32, got " + std::string(c10::toString(ts[i].scalar_type())));
  }
}

// The one dtype shared by a list of 16/32-bit tensors (all must match).
oa::DType common_dtype(const TensorList& ts, const char* list, bool allow_f32) {
  oa::DType d = oa::DType::f32;
  for (size_t i = 0; i < ts.size(); ++i) {
    oa::DType di;
    switch (ts[i].scalar_type()) {
      case at::kFloat: di = oa::DType::f32; break;
      case at::kBFloat16: di = oa::DType::bf16; break;
      case at::kHalf: di = oa::DType::f16; break;
      default:
        fail_type(where(list, i) + " has dtype " + std::string(c10::toString(ts[i].scalar_type())) +
                  "; expected " + (allow_f32 ? "float32, bfloat16 or float16" : "bfloat16 or float16"));
    }
    if (!allow_f32 && di == oa::DType::f32) fail_type(where(list, i) + " must be bfloat16 or float16, got float32");
    if (i == 0) d = di;
    else if (di != d) fail_type(std::string(list) + " mixes dtypes: all tensors of one call must share one dtype");
  }
  return d;
}

void check_same_length(size_t n, const TensorList& ts, const char* list, bool optional) {
  if (optional && ts.empty()) return;
  if (ts.size() != n)
    fail_value(std::string(list) + " has " + std::to_string(ts.size()) + " tensors, params has " + std::to_string(n));
}

const char* state_name(oa::StateDType d) {
  return d == oa::StateDType::f32 ? "float32" : d == oa::StateDType::bf16 ? "bfloat16" : "uint8 (8-bit codes)";
}

// The moments' storage format, from their dtype: float32, bfloat16 or uint8 (8-bit
// codes). exp_avgs, exp_avg_sqs and max_exp_avg_sqs of one call share it.
oa::StateDType moment_format(const std::vector<std::pair<const TensorList*, const char*>>& lists) {
  bool seen = false;
  oa::StateDType d = oa::StateDType::f32;
  for (const auto& [ts, list] : lists) {
    for (size_t i = 0; i < ts->size(); ++i) {
      oa::StateDType di;
      switch ((*ts)[i].scalar_type()) {
        case at::kFloat: di = oa::StateDType::f32; break;
        case at::kBFloat16: di = oa::StateDType::bf16; break;
        case at::kByte: di = oa::StateDType::q8; break;
        default:
          fail_type(where(list, i) + " has dtype " + std::string(c10::toString((*ts)[i].scalar_type())) +
                    "; moments must be float32, bfloat16 or uint8 (8-bit codes with exp_avg_scales)");
      }
      if (!seen) d = di, seen = true;
      else if (di != d)
        fail_type(where(list, i) + " is " + state_name(di) + " but exp_avgs[0] is " + state_name(d) +
                  ": all moments of one call share one format");
    }
  }
  return d;
}

// q8 scales: one float32 tensor of quant_blocks(numel) elements per param, for each
// moment; none for the other formats.
void check_scales(const TensorList& scales, const char* list, const std::vector<int64_t>& numels, oa::StateDType d) {
  if (d != oa::StateDType::q8) {
    if (!scales.empty()) fail_value(std::string(list) + " are only for 8-bit (uint8) moments; leave it empty");
    return;
  }
  if (scales.size() != numels.size())
    fail_value(std::string(list) + " has " + std::to_string(scales.size()) + " tensors, params has " +
               std::to_string(numels.size()) + ": 8-bit moments need one float32 tensor of ceil(numel / " +
               std::to_string(oa::kQuantBlock) + ") block scales per param");
  for (size_t i = 0; i < scales.size(); ++i) {
    check_cpu_contiguous(scales[i], list, i);
    if (scales[i].scalar_type() != at::kFloat)
      fail_type(where(list, i) + " must be float32, got " + std::string(c10::toString(scales[i].scalar_type())));
    const int64_t want = oa::quant_blocks(numels[i]);
    if (scales[i].numel() != want)
      fail_value(where(list, i) + " has " + std::to_string(scales[i].numel()) + " elements; its param's " +
                 std::to_string(numels[i]) + " elements need ceil(numel / " +
                 std::to_string(oa::kQuantBlock) + ") = " + std::to_string(want));
  }
}

// Builds the kernel's view of a bucket; the tensors must outlive its use.
struct BucketView {
  std::vector<oa::AdamTensor> tensors;
  oa::Bucket bucket;
};

// A split master (split_master.h: master_los and master_ties given) has no fp32 params:
// params is empty, lp_params holds the bf16 halves and says each tensor's size.
BucketView make_bucket(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                       const TensorList& exp_avg_sqs, const TensorList& max_exp_avg_sqs,
                       const TensorList& lp_params, const TensorList& exp_avg_scales,
                       const TensorList& exp_avg_sq_scales, const std::vector<int64_t>& first_indices,
                       const TensorList& master_los = {}, const TensorList& master_ties = {}) {
  const bool split = !master_los.empty() || !master_ties.empty();
  if (split && !params.empty())
    fail_value("params must be empty with master_los and master_ties: a split master has no fp32 copy");
  if (split && lp_params.empty()) fail_value("a split master needs lp_params: they hold its bf16 halves");
  const TensorList& sized = split ? lp_params : params;
  const size_t n = sized.size();
  std::vector<int64_t> numels(n);
  for (size_t i = 0; i < n; ++i) numels[i] = sized[i].numel();
  if (split) {
    check_same_length(n, master_los, "master_los", false);
    check_same_length(n, master_ties, "master_ties", false);
    for (size_t i = 0; i < n; ++i) {
      if (lp_params[i].scalar_type() != at::kBFloat16)
        fail_type(where("lp_params", i) + " must be bfloat16 with a split master, got " +
                  std::string(c10::toString(lp_params[i].scalar_type())));
      check_cpu_contiguous(master_los[i], "master_los", i);
      check_cpu_contiguous(master_ties[i], "master_ties", i);
      if (master_los[i].scalar_type() != at::kShort || master_ties[i].scalar_type() != at::kByte)
        fail_type(where("master_los", i) + " must be int16 and " + where("master_ties", i) + " uint8");
      check_numel(master_los[i], "master_los", i, numels[i]);
      check_numel(master_ties[i], "master_ties", i, (numels[i] + 7) / 8);
    }
  }
  check_same_length(n, grads, "grads", false);
  check_same_length(n, exp_avgs, "exp_avgs", false);
  check_same_length(n, exp_avg_sqs, "exp_avg_sqs", false);
  check_same_length(n, max_exp_avg_sqs, "max_exp_avg_sqs", true);
  check_same_length(n, lp_params, "lp_params", true);
  check_float32(params, "params");
  const oa::StateDType fmt = moment_format(
      {{&exp_avgs, "exp_avgs"}, {&exp_avg_sqs, "exp_avg_sqs"}, {&max_exp_avg_sqs, "max_exp_avg_sqs"}});
  if (fmt == oa::StateDType::q8 && !max_exp_avg_sqs.empty())
    fail_value("max_exp_avg_sqs: amsgrad is not supported with 8-bit (uint8) moments; use float32 or bfloat16 moments");
  for (const auto& [ts, list] : {std::pair<const TensorList*, const char*>{&exp_avgs, "exp_avgs"},
                                 {&exp_avg_sqs, "exp_avg_sqs"}, {&max_exp_avg_sqs, "max_exp_avg_sqs"},
                                 {&grads, "grads"}, {&lp_params, "lp_params"}})
    for (size_t i = 0; i < ts->size(); ++i) {
      check_cpu_contiguous((*ts)[i], list, i);
      check_numel((*ts)[i], list, i, numels[i]);
    }
  check_scales(exp_avg_scales, "exp_avg_scales", numels, fmt);
  check_scales(exp_avg_sq_scales, "exp_avg_sq_scales", numels, fmt);
  if (!first_indices.empty()) {
    if (first_indices.size() != n)
      fail_value("first_indices has " + std::to_string(first_indices.size()) + " entries, params has " +
                 std::to_string(n));
    for (size_t i = 0; i < n; ++i)
      if (first_indices[i] < 0 || first_indices[i] % oa::kChunk != 0)
        fail_value(where("first_indices", i) + " is " + std::to_string(first_indices[i]) +
                   "; a range of a tensor must start at a non-negative multiple of " +
                   std::to_string(oa::kChunk) + " elements");
  }
  BucketView v;
  v.bucket.grad_dtype = common_dtype(grads, "grads", true);
  v.bucket.lp_dtype = lp_params.empty() ? oa::DType::bf16 : common_dtype(lp_params, "lp_params", false);
  v.bucket.state_dtype = fmt;
  v.tensors.resize(n);
  for (size_t i = 0; i < n; ++i) {
    oa::AdamTensor& t = v.tensors[i];
    t.param = split ? nullptr : params[i].data_ptr<float>();
    if (split) {
      t.master_lo = static_cast<uint16_t*>(master_los[i].data_ptr());
      t.master_tie = master_ties[i].data_ptr<uint8_t>();
    }
    t.exp_avg = exp_avgs[i].data_ptr();
    t.exp_avg_sq = exp_avg_sqs[i].data_ptr();
    t.max_exp_avg_sq = max_exp_avg_sqs.empty() ? nullptr : max_exp_avg_sqs[i].data_ptr();
    if (fmt == oa::StateDType::q8) {
      t.exp_avg_scale = exp_avg_scales[i].data_ptr<float>();
      t.exp_avg_sq_scale = exp_avg_sq_scales[i].data_ptr<float>();
    }
    t.grad = grads[i].data_ptr();
    t.param_lp = lp_params.empty() ? nullptr : lp_params[i].data_ptr();
    t.numel = numels[i];
    t.first_index = first_indices.empty() ? 0 : first_indices[i];
  }
  v.bucket.tensors = v.tensors.data();
  v.bucket.count = static_cast<int64_t>(n);
  return v;
}

int check_threads(int64_t num_threads) {
  if (num_threads < 1) fail_value("num_threads must be >= 1, got " + std::to_string(num_threads));
  return static_cast<int>(std::min<int64_t>(num_threads, 1024));
}

void adam_step(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
               const TensorList& exp_avg_sqs, const TensorList& max_exp_avg_sqs, const TensorList& lp_params,
               const TensorList& steps, double lr, double beta1, double beta2, double eps, double weight_decay,
               bool decoupled, bool maximize, double grad_scale, int64_t num_threads,
               const TensorList& exp_avg_scales, const TensorList& exp_avg_sq_scales,
               const std::vector<int64_t>& first_indices, double grad_mul, const TensorList& master_los,
               const TensorList& master_ties) {
  BucketView v = make_bucket(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, lp_params, exp_avg_scales,
                             exp_avg_sq_scales, first_indices, master_los, master_ties);
  check_same_length(v.tensors.size(), steps, "steps", false);
  // torch keeps the step count as a float32 0-dim tensor per param; the kernel
  // counts this step (+1) and writes the counts back only when it succeeded.
  // Read and written through the raw pointer: item()/fill_() would cost a
  // dispatcher round trip per tensor, which dominates steps of many small params.
  std::vector<float*> step_ptrs(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    const at::Tensor& s = steps[i];
    if (!s.device().is_cpu() || s.numel() != 1 || s.scalar_type() != at::kFloat)
      fail_type(where("steps", i) + " must be a one-element float32 CPU tensor (torch's state['step'])");
    step_ptrs[i] = s.data_ptr<float>();
    // A float32 count stops at 2^24 (+1 rounds back to it): torch's step then stalls,
    // harmless to its bias corrections, but the stochastic rounding of bf16/8-bit
    // moments keys its bits on the count, and would round alike every step (biased).
    if (exp_avgs[i].scalar_type() != at::kFloat && *step_ptrs[i] + 1.0f == *step_ptrs[i])
      fail_value(where("steps", i) + " is " + std::to_string(static_cast<int64_t>(*step_ptrs[i])) +
                 ": a float32 step count (torch's state['step']) stops counting at 2^24, and the "
                 "stochastic rounding of bfloat16/8-bit moments draws its bits from it (past it "
                 "they would round alike each step: biased). Use state_dtype=torch.float32 for a "
                 "run this long, or set the step count lower; nothing was stepped");
    v.tensors[i].step = static_cast<int64_t>(*step_ptrs[i]) + 1;
  }
  oa::AdamHyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.decoupled = decoupled;
  h.amsgrad = !max_exp_avg_sqs.empty();
  h.maximize = maximize;
  h.grad_scale = grad_scale;
  h.grad_mul = grad_mul;
  const int threads = check_threads(num_threads);
  {
    py::gil_scoped_release no_gil;
    oa::adam_step(v.bucket, h, threads);
  }
  for (size_t i = 0; i < steps.size(); ++i) *step_ptrs[i] += 1.0f;
}

void stream_limit(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                  const TensorList& exp_avg_sqs, const TensorList& lp_params, int64_t num_threads,
                  const TensorList& exp_avg_scales, const TensorList& exp_avg_sq_scales) {
  BucketView v = make_bucket(params, grads, exp_avgs, exp_avg_sqs, {}, lp_params, exp_avg_scales, exp_avg_sq_scales,
                             {});
  const int threads = check_threads(num_threads);
  py::gil_scoped_release no_gil;
  oa::stream_limit(v.bucket, threads);
}

std::vector<double> grad_sq_sums(const TensorList& grads, int64_t num_threads) {
  std::vector<oa::AdamTensor> tensors(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    check_cpu_contiguous(grads[i], "grads", i);
    tensors[i].grad = grads[i].data_ptr();
    tensors[i].numel = grads[i].numel();
  }
  oa::Bucket b;
  b.grad_dtype = common_dtype(grads, "grads", true);
  b.tensors = tensors.data();
  b.count = static_cast<int64_t>(tensors.size());
  std::vector<double> out(grads.size(), 0.0);
  const int threads = check_threads(num_threads);
  py::gil_scoped_release no_gil;
  oa::grad_sq_sums(b, out.data(), threads);
  return out;
}

// 8-bit moments to and from fp32 (checkpoints, another optimizer's state). The
// values are exp_avg, or exp_avg_sq (v, coded as sqrt(v)) when second_moment.
void check_q8_pair(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& values) {
  check_cpu_contiguous(values, "values", 0);
  check_cpu_contiguous(codes, "codes", 0);
  check_cpu_contiguous(scales, "scales", 0);
  if (values.scalar_type() != at::kFloat) fail_type("values must be float32");
  if (codes.scalar_type() != at::kByte) fail_type("codes must be uint8");
  if (scales.scalar_type() != at::kFloat) fail_type("scales must be float32");
  if (codes.numel() != values.numel())
    fail_value("codes has " + std::to_string(codes.numel()) + " elements, values has " +
               std::to_string(values.numel()));
  if (scales.numel() != oa::quant_blocks(values.numel()))
    fail_value("scales has " + std::to_string(scales.numel()) + " elements; " + std::to_string(values.numel()) +
               " values need ceil(numel / " + std::to_string(oa::kQuantBlock) + ") = " +
               std::to_string(oa::quant_blocks(values.numel())));
}

void q8_encode(const at::Tensor& values, const at::Tensor& codes, const at::Tensor& scales, bool second_moment,
               int64_t num_threads) {
  check_q8_pair(codes, scales, values);
  const int threads = check_threads(num_threads);
  py::gil_scoped_release no_gil;
  oa::q8_encode(values.data_ptr<float>(), values.numel(), second_moment, codes.data_ptr<uint8_t>(),
                scales.data_ptr<float>(), threads);
}

void q8_decode(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& values, bool second_moment,
               int64_t num_threads) {
  check_q8_pair(codes, scales, values);
  const int threads = check_threads(num_threads);
  py::gil_scoped_release no_gil;
  oa::q8_decode(codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), values.numel(), second_moment,
                values.data_ptr<float>(), threads);
}

// fp32 masters <-> split masters (split_master.h): bf16 halves, int16 low halves, uint8
// tie bits (ceil(n / 8)).
void check_split(const at::Tensor& masters, const at::Tensor& params, const at::Tensor& lo, const at::Tensor& tie) {
  const std::pair<const at::Tensor*, const char*> all[] = {
      {&masters, "masters"}, {&params, "params"}, {&lo, "lo"}, {&tie, "tie"}};
  for (const auto& [t, name] : all) check_cpu_contiguous(*t, name, 0);
  if (masters.scalar_type() != at::kFloat) fail_type("masters must be float32");
  if (params.scalar_type() != at::kBFloat16) fail_type("params must be bfloat16");
  if (lo.scalar_type() != at::kShort) fail_type("lo must be int16");
  if (tie.scalar_type() != at::kByte) fail_type("tie must be uint8");
  const int64_t n = masters.numel();
  if (params.numel() != n || lo.numel() != n || tie.numel() != (n + 7) / 8)
    fail_value("masters has " + std::to_string(n) + " elements: params and lo need as many, tie ceil(n / 8) = " +
               std::to_string((n + 7) / 8) + "; got " + std::to_string(params.numel()) + ", " +
               std::to_string(lo.numel()) + ", " + std::to_string(tie.numel()));
}

void split_master_encode(const at::Tensor& masters, const at::Tensor& params, const at::Tensor& lo,
                         const at::Tensor& tie, int64_t num_threads) {
  check_split(masters, params, lo, tie);
  const int threads = check_threads(num_threads);
  py::gil_scoped_release no_gil;
  oa::split_master_encode(masters.data_ptr<float>(), masters.numel(), static_cast<uint16_t*>(params.data_ptr()),
                          static_cast<uint16_t*>(lo.data_ptr()), tie.data_ptr<uint8_t>(), threads);
}

void split_master_decode(const at::Tensor& params, const at::Tensor& lo, const at::Tensor& tie,
                         const at::Tensor& masters, int64_t num_threads) {
  check_split(masters, params, lo, tie);
  const int threads = check_threads(num_threads);
  py::gil_scoped_release no_gil;
  oa::split_master_decode(static_cast<const uint16_t*>(params.data_ptr()),
                          static_cast<const uint16_t*>(lo.data_ptr()), tie.data_ptr<uint8_t>(), masters.numel(),
                          masters.data_ptr<float>(), threads);
}

// oa::grad_fingerprint of a grad's bits (a CPU tensor of int16 or int32 words) with the
// weights of a chunk's positions (int64; their count is the chunk).
int64_t grad_fingerprint(const at::Tensor& bits, const at::Tensor& weights) {
  check_cpu_contiguous(bits, "bits", 0);
  check_cpu_contiguous(weights, "weights", 0);
  if (bits.scalar_type() != at::kShort && bits.scalar_type() != at::kInt)
    fail_type("bits must be int16 or int32 (a grad's bit patterns), got " +
              std::string(c10::toString(bits.scalar_type())));
  if (weights.scalar_type() != at::kLong)
    fail_type("weights must be int64, got " + std::string(c10::toString(weights.scalar_type())));
  if (weights.numel() < 1) fail_value("weights must hold at least one weight (one per position of a chunk)");
  py::gil_scoped_release no_gil;
  return oa::grad_fingerprint(bits.data_ptr(), static_cast<int>(bits.element_size()), bits.numel(),
                              weights.data_ptr<int64_t>(), weights.numel());
}

// oa::crc32c of a contiguous buffer: bytes, or a memoryview (the NVMe tier's I/O threads
// hold slices of an mmap); a non-contiguous one is a BufferError. The buffer is held
// (an mmap cannot close under it) and the GIL released while it runs, so the I/O threads
// checksum in parallel. `value`: a CRC32C to continue (0 starts one).
uint32_t crc32c_of_buffer(const py::object& data, uint32_t value) {
  Py_buffer view;
  if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_SIMPLE) != 0) throw py::error_already_set();
  struct Held {
    Py_buffer* view;
    ~Held() { PyBuffer_Release(view); }  // after the GIL is taken back (declared first)
  } held{&view};
  py::gil_scoped_release no_gil;
  return oa::crc32c(value, view.buf, static_cast<int64_t>(view.len));
}

std::vector<std::string> supported_isa_names() {
  std::vector<std::string> out;
  for (oa::Isa isa : oa::supported_isas()) out.emplace_back(oa::isa_name(isa));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "offload_adam fused CPU Adam/AdamW kernels";
  // The moments' dtype selects their format: float32, bfloat16, or uint8 codes with
  // float32 block scales (exp_avg_scales, exp_avg_sq_scales: ceil(numel / 256) each).
  m.def("adam_step", &adam_step, "One fused Adam/AdamW step over a bucket of tensors", py::arg("params"),
        py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"),
        py::arg("lp_params"), py::arg("steps"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("decoupled"), py::arg("maximize"), py::arg("grad_scale"),
        py::arg("num_threads"), py::arg("exp_avg_scales") = TensorList{}, py::arg("exp_avg_sq_scales") = TensorList{},
        py::arg("first_indices") = std::vector<int64_t>{}, py::arg("grad_mul") = 1.0,
        py::arg("master_los") = TensorList{}, py::arg("master_ties") = TensorList{});
  m.def("stream_limit", &stream_limit, "The loads and stores of adam_step without its arithmetic",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("lp_params"),
        py::arg("num_threads"), py::arg("exp_avg_scales") = TensorList{},
        py::arg("exp_avg_sq_scales") = TensorList{});
  m.def("quant_block_size", [] { return oa::kQuantBlock; }, "Elements per 8-bit block (one scale per moment each)");
  m.def("q8_encode", &q8_encode, "fp32 moment -> 8-bit codes and block scales (round to nearest)",
        py::arg("values"), py::arg("codes"), py::arg("scales"), py::arg("second_moment"), py::arg("num_threads") = 1);
  m.def("q8_decode", &q8_decode, "8-bit codes and block scales -> fp32 moment", py::arg("codes"), py::arg("scales"),
        py::arg("values"), py::arg("second_moment"), py::arg("num_threads") = 1);
  // A split master (csrc/split_master.h): the bf16 param, the master's low 16 bits (int16)
  // and tie bits (uint8, 8 per byte); adam_step takes one with master_los/master_ties.
  m.def("split_master_encode", &split_master_encode, "fp32 masters -> bf16 params, low halves, tie bits",
        py::arg("masters"), py::arg("params"), py::arg("lo"), py::arg("tie"), py::arg("num_threads") = 1);
  m.def("split_master_decode", &split_master_decode, "bf16 params, low halves, tie bits -> fp32 masters",
        py::arg("params"), py::arg("lo"), py::arg("tie"), py::arg("masters"), py::arg("num_threads") = 1);
  m.def("grad_sq_sums", &grad_sq_sums, "Per-tensor sum of squares, accumulated in double", py::arg("grads"),
        py::arg("num_threads"));
  m.def("grad_fingerprint", &grad_fingerprint,
        "A grad's fingerprint from its bits and a chunk's weights (engine/grads.py); the GIL is released",
        py::arg("bits"), py::arg("weights"));
  m.def("crc32c", &crc32c_of_buffer, "CRC32C (Castagnoli) of a buffer, continuing value; the GIL is released",
        py::arg("data"), py::arg("value") = 0);
  m.def("threads_refused", &oa::threads_refused,
        "How many of the kernels' thread starts the system has refused (the work ran on fewer)");
  m.def("isa", [] { return std::string(oa::isa_name(oa::active_isa())); }, "The active ISA variant");
  m.def("supported_isas", &supported_isa_names, "ISA variants this CPU runs, best first");
  m.def("set_isa", &oa::set_isa, "Select an ISA variant: avx512, avx2, neon, scalar or auto", py::arg("name"));
  // OFFLOAD_ADAM_ISA is applied by the loader (offload_adam/_build.py) through
  // set_isa, so a bad value raises ValueError/RuntimeError rather than ImportError.
}
