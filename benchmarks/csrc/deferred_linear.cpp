// A prototype, measured by benchmarks/linear_capture.py, not used by zbpipe: the deferred Linear's
// weight-gradient capture as a C++ autograd Function. The same formulas as the Python
// autograd.Function in src/zbpipe/engines/weight_capture.py (input gradient g @ W, bias gradient
// the column sum, the weight GEMM queued while the store defers, or added into .grad at once
// for a fused BW through the store), with no Python in F or B beyond the one call that enters
// it. Stores live here, keyed by an integer the caller picks; W takes their entries back.
#include <torch/extension.h>
#include <unordered_map>
#include <vector>
#include <tuple>

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using torch::Tensor;

struct Store {
  bool deferring = false;
  bool immediate = false;
  std::vector<std::tuple<Tensor, Tensor, Tensor>> entries;
};
static std::unordered_map<int64_t, Store> stores;

static Tensor to2d(const Tensor& t) { return t.dim() == 2 ? t : t.reshape({-1, t.size(-1)}); }

struct DeferredLinearFn : public torch::autograd::Function<DeferredLinearFn> {
  static Tensor forward(AutogradContext* ctx, Tensor x, Tensor w, std::optional<Tensor> b, int64_t sid) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["sid"] = sid;
    ctx->saved_data["has_bias"] = b.has_value();
    return at::linear(x, w, b);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    Tensor x = saved[0], w = saved[1];
    Tensor g = grads[0];
    Tensor g2d = to2d(g);
    Tensor gx, gw, gb;
    if (ctx->needs_input_grad(0)) gx = g.matmul(w);
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) gb = g2d.sum(0);
    if (ctx->needs_input_grad(1)) {
      Tensor x2d = to2d(x);
      auto& st = stores[ctx->saved_data["sid"].toInt()];
      if (st.deferring && !at::GradMode::is_enabled()) {
        Tensor& grad = w.mutable_grad();
        if (st.immediate && grad.defined() && grad.dtype() == x2d.dtype()) {
          grad.addmm_(g2d.t(), x2d);
        } else {
          st.entries.emplace_back(w, x2d, g2d);
        }
      } else {
        gw = g2d.t().mm(x2d);
      }
    }
    return {gx, gw, gb, Tensor()};
  }
};

Tensor deferred_linear(Tensor x, Tensor w, std::optional<Tensor> b, int64_t sid) {
  return DeferredLinearFn::apply(x, w, b, sid);
}
void set_flags(int64_t sid, bool deferring, bool immediate) {
  auto& st = stores[sid]; st.deferring = deferring; st.immediate = immediate;
}
std::vector<std::tuple<Tensor, Tensor, Tensor>> take(int64_t sid) {
  auto it = stores.find(sid);
  if (it == stores.end()) return {};
  auto out = std::move(it->second.entries);
  stores.erase(it);
  return out;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("deferred_linear", &deferred_linear);
  m.def("set_flags", &set_flags);
  m.def("take", &take);
}
