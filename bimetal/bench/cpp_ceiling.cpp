// `bimetal bench comm --transports ...,cpp-ceiling`: a process group written in C++ whose send and receive
// make the checks of cpu-forward's one-message fast path and hand back Gloo's own work, for a message of any
// size. It is the least a compiled group in front of Gloo adds, beside `py-ceiling` (the same in Python): how
// much of what separates cpu-forward x1 from Gloo only leaving Python would win. A benchmark variant, built on
// first use with torch.utils.cpp_extension; not a transport: everything but send, recv and barrier is refused.
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <string>
#include <utility>
#include <vector>

namespace {

class CppCeiling : public c10d::Backend {
 public:
  explicit CppCeiling(c10::intrusive_ptr<c10d::Backend> gloo)
      : c10d::Backend(gloo->getRank(), gloo->getSize()), gloo_(std::move(gloo)) {}

  const std::string getBackendName() const override { return "bimetal_cpp_ceiling"; }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    check(tensors, dst, "send");
    return gloo_->send(tensors, dst, tag);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    check(tensors, src, "recv");
    return gloo_->recv(tensors, src, tag);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return gloo_->barrier(opts);
  }

 private:
  // what the fast path checks before it posts: one contiguous CPU tensor, a peer of the group
  void check(const std::vector<at::Tensor>& tensors, int peer, const char* op) const {
    TORCH_CHECK(tensors.size() == 1 && tensors[0].is_cpu() && tensors[0].is_contiguous(),
                "cpp-ceiling ", op, ": one contiguous CPU tensor");
    TORCH_CHECK(peer >= 0 && peer < getSize() && peer != getRank(), "cpp-ceiling ", op, ": no peer ", peer);
  }

  c10::intrusive_ptr<c10d::Backend> gloo_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::module::import("torch.distributed");  // registers c10d::Backend with pybind11 first
  py::class_<CppCeiling, c10d::Backend, c10::intrusive_ptr<CppCeiling>>(m, "CppCeiling")
      .def(py::init<c10::intrusive_ptr<c10d::Backend>>(), py::arg("gloo"));
}
