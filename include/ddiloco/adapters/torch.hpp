// ddiloco/adapters/torch.hpp: libtorch tensors (`torch::Tensor`) as ddiloco tensors.
//
// What it is: a STAGED-form `ddiloco::tensor_traits<at::Tensor>` (torch::Tensor is
// the same type), so a libtorch module's `parameters()` go straight into OuterLoop:
//
//     std::vector<torch::Tensor> params = model->parameters();
//     ddiloco::OuterLoop<Transport, torch::Tensor> outer(plan, transport, config);
//     outer.join(params);
//
// The flat order ddiloco sees is the tensor's contiguous (row-major) order.
//   - Reading (the fragment being sent): a CPU tensor is copied with one memcpy
//     from data_ptr(); a tensor on another device is first copied to the host
//     (`.to(kCPU)`), for that fragment only.
//   - Writing (a global fragment applied, or the state received at join): the
//     host values are copied IN PLACE into the existing tensor (`copy_` under a
//     NoGradGuard, on the tensor's own device), so the module's parameters stay
//     the same objects, keep `requires_grad`, and the inner optimizer (AdamW...)
//     keeps pointing at them. The copy bumps the tensor's version counter, so a
//     stale autograd graph that saved the old values fails loudly on backward.
//
// What it is not: a converter. The contract is float32, strided, contiguous:
//   - another dtype (float64, bfloat16, int...) is refused with InvalidArgument
//     naming the dtype and shape (convert the model: `model->to(torch::kFloat32)`);
//   - a non-contiguous tensor (a transposed or sliced view) is refused, because a
//     `.contiguous()` copy would silently lose ddiloco's writes;
//   - undefined and sparse tensors are refused.
// The trait sees a tensor, not its name; its messages give dtype, shape and
// strides, and OuterLoop's own checks (the sizes, every step) name the tensor.
// Include this header only where libtorch is available (CMake: find_package(Torch)).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cstddef>
#include <cstring>
#include <span>
#include <sstream>
#include <string>

#include <ddiloco/error.hpp>
#include <ddiloco/tensor.hpp>

namespace ddiloco {

namespace detail {

/// "[2, 3]" for a shape or a stride list.
inline std::string torch_dims(c10::IntArrayRef dims) {
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
  os << ']';
  return os.str();
}

/// Throws InvalidArgument unless `t` is a defined, strided, contiguous float32
/// tensor (on any device). `what` names the caller in the message.
inline void check_torch_tensor(const at::Tensor& t, const char* what) {
  constexpr const char* who = "ddiloco::tensor_traits<torch::Tensor>::";
  constexpr const char* unnamed =
      " (the trait does not know the tensor's name: it is one of the tensors you passed, in plan order)";
  if (!t.defined())
    throw InvalidArgument(msg(who, what, ": the tensor is undefined", unnamed,
                              "; pass the model's parameters, e.g. model->parameters()"));
  if (t.layout() != at::kStrided)
    throw InvalidArgument(msg(who, what, ": a tensor of shape ", torch_dims(t.sizes()), " has layout ",
                              t.layout(), unnamed, "; ddiloco needs dense (strided) tensors: call .to_dense()"));
  if (t.scalar_type() != at::kFloat)
    throw InvalidArgument(msg(who, what, ": a tensor of dtype ", c10::toString(t.scalar_type()), " and shape ",
                              torch_dims(t.sizes()), " is not float32", unnamed,
                              "; ddiloco works on fp32 parameters: convert the model with "
                              "model->to(torch::kFloat32) before building the plan"));
  if (!t.is_contiguous())
    throw InvalidArgument(msg(who, what, ": a tensor of shape ", torch_dims(t.sizes()), " and strides ",
                              torch_dims(t.strides()), " is not contiguous (a transposed or sliced view?)",
                              unnamed, "; ddiloco writes merged values back in place, so a .contiguous() copy "
                              "would lose them: pass the contiguous parameter itself"));
}

}  // namespace detail

/// Staged form for torch::Tensor (== at::Tensor): see the header comment.
template <>
struct tensor_traits<at::Tensor> {
  static std::size_t size(const at::Tensor& t) {
    detail::check_torch_tensor(t, "size");
    return static_cast<std::size_t>(t.numel());
  }

  static void copy_to_host(const at::Tensor& t, std::span<float> dst) {
    detail::check_torch_tensor(t, "copy_to_host");
    detail::check_buffer_size("tensor_traits<torch::Tensor>::copy_to_host", dst.size(),
                              static_cast<std::size_t>(t.numel()));
    if (dst.empty()) return;
    if (t.is_cpu()) {
      std::memcpy(dst.data(), t.data_ptr<float>(), dst.size() * sizeof(float));
    } else {
      // Another device: one host copy of this tensor, for the fragment being sent.
      const at::Tensor host = t.detach().to(at::kCPU).contiguous();
      std::memcpy(dst.data(), host.data_ptr<float>(), dst.size() * sizeof(float));
    }
  }

  static void copy_from_host(at::Tensor& t, std::span<const float> src) {
    detail::check_torch_tensor(t, "copy_from_host");
    detail::check_buffer_size("tensor_traits<torch::Tensor>::copy_from_host", src.size(),
                              static_cast<std::size_t>(t.numel()));
    if (src.empty()) return;
    // A view of the caller's host buffer; from_blob does not take ownership
    // and copy_ only reads it (the const_cast never leads to a write).
    const at::Tensor host = at::from_blob(const_cast<float*>(src.data()), t.sizes(), at::kFloat);
    // In place, without recording the write in autograd: a parameter that
    // requires grad stays the same leaf (same TensorImpl, same storage).
    c10::NoGradGuard no_grad;
    t.copy_(host);
  }
};

}  // namespace ddiloco
