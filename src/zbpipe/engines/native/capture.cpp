// zbpipe's native weight capture: the deferred engine's Linear as a C++ autograd Function.
//
// The formulas of the Python autograd.Function in zbpipe/engines/weight_capture.py
// (_LinearFunction), op for op, so the gradients are bitwise the same:
//   F: autocast's dtype noted (the input cast to it, as autocast's own Linear saves it), the
//      input and weight saved through autograd (saved-tensor hooks see them: activation
//      checkpointing, zbpipe's memory meter), at::linear.
//   B: the input gradient g @ W (cast back to the input's dtype), the bias gradient the column
//      sum, and the weight GEMM g^T @ x queued in the microbatch's Queue while zbpipe's B defers
//      (grad mode off), or computed and returned (a fused backward, create_graph=True: then the
//      ops record a graph, so second-order gradients flow as through the Python Function).
// A Queue belongs to one (stage, microbatch) store (zbpipe.engines.deferred.WeightGradStore).
// What it adds to .grad itself, inside the GEMM (grad.addmm_(g^T, x), as the Python store's
// accumulate.add_product does), is only the common case: a plain strided .grad of the input's
// dtype, no autocast dtype, no post-accumulate hook, not exact. Everything else is handed back
// to Python by run(), in queue order, and a weight handed back once is handed back for the
// rest of the queue, so each weight's products are added in the order autograd made them.
// No Python object is touched in B: autograd's engine runs it without the GIL.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <tuple>
#include <unordered_set>
#include <vector>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using Entry = std::tuple<Tensor, Tensor, Tensor, std::optional<at::ScalarType>>;

Tensor rows(const Tensor& t) { return t.dim() == 2 ? t : t.reshape({-1, t.size(-1)}); }

bool python_tensor(const Tensor& t) {
  return t.key_set().has(c10::DispatchKey::Python);  // a tensor subclass (DTensor)
}

// accumulate.add_product's common case: .grad is added inside the GEMM.
bool adds_in_gemm(const Tensor& weight, const Tensor& x) {
  const Tensor& grad = weight.grad();
  return grad.defined() && grad.layout() == at::kStrided &&
         grad.scalar_type() == x.scalar_type() && !python_tensor(grad) &&
         !python_tensor(weight) && !python_tensor(x) &&
         !torch::autograd::impl::post_acc_grad_hooks(weight);
}

struct Queue : torch::CustomClassHolder {
  Queue(bool immediate, bool exact) : immediate(immediate), exact(exact) {}

  bool deferring = false;  // zbpipe's B runs: queue the weight GEMMs
  const bool immediate;    // a fused BW through the store: add the common case at once
  const bool exact;        // W adds as AccumulateGrad does: Python runs every entry
  bool closed = false;     // run() or clear() was called
  std::vector<Entry> entries;

  void put(const Tensor& weight, Tensor x2d, Tensor g2d, std::optional<at::ScalarType> dtype) {
    TORCH_CHECK(!closed, "zbpipe: a weight gradient was queued after its W ran");
    if (immediate && !exact && !dtype && !queued(weight) && adds_in_gemm(weight, x2d)) {
      weight.grad().addmm_(g2d.t(), x2d);
      return;
    }
    entries.emplace_back(weight, std::move(x2d), std::move(g2d), dtype);
  }

  bool queued(const Tensor& weight) const {
    for (const auto& e : entries) {
      if (std::get<0>(e).is_same(weight)) return true;
    }
    return false;
  }

  // W: the common case added here; the rest returned, in order, for the Python store.
  std::vector<Entry> run() {
    TORCH_CHECK(!closed, "zbpipe: WeightGradStore.run() was called twice: the weight pass of a "
                         "microbatch runs once");
    closed = true;
    std::vector<Entry> todo = std::move(entries);
    entries.clear();
    std::vector<Entry> rest;
    std::unordered_set<const c10::TensorImpl*> handed_back;
    at::NoGradGuard no_grad;
    for (auto& e : todo) {
      Tensor weight = std::move(std::get<0>(e));
      const auto* impl = weight.unsafeGetTensorImpl();
      if (!exact && !std::get<3>(e) && !handed_back.count(impl) &&
          adds_in_gemm(weight, std::get<1>(e))) {
        weight.grad().addmm_(std::get<2>(e).t(), std::get<1>(e));
      } else {
        handed_back.insert(impl);
        rest.emplace_back(std::move(weight), std::move(std::get<1>(e)), std::move(std::get<2>(e)),
                          std::get<3>(e));
      }
      e = Entry();  // each entry's activations go as soon as its GEMM ran
    }
    return rest;
  }

  void clear() {
    closed = true;
    entries.clear();
  }
};

// What B needs beyond the saved tensors (the Python Function's ctx.state).
struct LinearState : torch::CustomClassHolder {
  c10::intrusive_ptr<Queue> queue;
  Tensor weight;  // the leaf W accumulates into (checkpointing unpacks a detached copy)
  std::optional<at::ScalarType> dtype;  // autocast's
  at::ScalarType x_dtype;
  std::optional<at::ScalarType> bias_dtype;
};

Tensor weight_grad(const Tensor& g2d, const Tensor& x2d, std::optional<at::ScalarType> dtype,
                   at::ScalarType out) {
  if (dtype) return g2d.to(*dtype).t().mm(x2d.to(*dtype)).to(out);
  return g2d.t().mm(x2d);
}

struct ZbpipeDeferredLinear : public torch::autograd::Function<ZbpipeDeferredLinear> {
  static Tensor forward(AutogradContext* ctx, Tensor x, const Tensor& weight,
                        const std::optional<Tensor>& bias, c10::intrusive_ptr<Queue> queue) {
    auto state = c10::make_intrusive<LinearState>();
    const auto device = x.device().type();
    if (at::autocast::is_autocast_enabled(device)) {
      state->dtype = at::autocast::get_autocast_dtype(device);
    }
    state->x_dtype = x.scalar_type();
    if (state->dtype && state->x_dtype != *state->dtype && x.is_floating_point()) {
      x = x.to(*state->dtype);  // saved (and held until W) at the size autocast's Linear saves
    }
    ctx->save_for_backward({x, weight});
    state->queue = std::move(queue);
    state->weight = weight;
    if (bias && bias->defined()) state->bias_dtype = bias->scalar_type();
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return at::linear(x, weight, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];
    const Tensor& weight = saved[1];
    auto state = c10::static_intrusive_pointer_cast<LinearState>(
        ctx->saved_data["state"].toCapsule());
    const Tensor& grad_out = grads[0];
    Tensor g2d = rows(grad_out);
    Tensor grad_x, grad_w, grad_b;
    if (ctx->needs_input_grad(0)) {
      grad_x = grad_out.matmul(state->dtype ? weight.to(*state->dtype) : weight);
      if (grad_x.scalar_type() != state->x_dtype) grad_x = grad_x.to(state->x_dtype);
    }
    // the bias is the third edge only where there is one (edges are the tensor arguments)
    if (state->bias_dtype && ctx->needs_input_grad(2)) {
      grad_b = g2d.sum(0);
      if (state->bias_dtype && grad_b.scalar_type() != *state->bias_dtype) {
        grad_b = grad_b.to(*state->bias_dtype);
      }
    }
    if (ctx->needs_input_grad(1)) {
      Tensor x2d = rows(x);
      Queue& queue = *state->queue;
      if (queue.deferring && !at::GradMode::is_enabled()) {
        queue.put(state->weight, std::move(x2d), std::move(g2d), state->dtype);  // W computes it
      } else {  // a fused backward, or create_graph=True: an ordinary Linear
        grad_w = weight_grad(g2d, x2d, state->dtype, weight.scalar_type());
      }
    }
    return {grad_x, grad_w, grad_b, Tensor()};
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zbpipe's native weight capture (zbpipe/engines/native/capture.cpp)";
  py::class_<Queue, c10::intrusive_ptr<Queue>>(m, "Queue")
      .def(py::init<bool, bool>(), py::arg("immediate"), py::arg("exact"))
      .def_readwrite("deferring", &Queue::deferring)
      .def_readonly("immediate", &Queue::immediate)
      .def_readonly("exact", &Queue::exact)
      .def(
          "linear",
          [](Queue& self, const Tensor& x, const Tensor& weight,
             const std::optional<Tensor>& bias) {
            return ZbpipeDeferredLinear::apply(x, weight, bias,
                                               c10::intrusive_ptr<Queue>::reclaim_copy(&self));
          },
          "F.linear(x, weight, bias) whose weight GEMM this queue takes in zbpipe's B")
      .def("run", &Queue::run, "W: add the common case, return the rest in order")
      .def("clear", &Queue::clear, "drop every entry (a failed step)")
      .def("__len__", [](const Queue& self) { return self.entries.size(); });
}
