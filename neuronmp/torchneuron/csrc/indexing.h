// What op tracking lists for aten::index on the device, as TorchNeuron's index kernel
// records it: that kernel turns each boolean mask on the device into integer indices
// with aten::nonzero (a device op of its own, listed); when a mask selects nothing it
// makes the empty result without running (or listing) its compiled kernel.  A call
// with an empty tensor among its arguments (the input, an index) is listed whatever
// its masks: TorchNeuron records such calls as it starts them.
//
//   index.Tensor       index_kernel(): records so, then runs torch's composite as the
//                      other composite device kernels do (optrack.h)
//   index.Tensor_out   the fallback records so (record()) before the CPU's kernel
//
// The indices are read through CPU aliases of the device's memory (`Alias`), so that
// inspecting them dispatches, and records, nothing on the device.
#pragma once

#include <torch/library.h>

#include "optrack.h"

namespace neuronmp_indexing {

inline bool is_index_out(const neuronmp_optrack::Slot* slot) {
  static auto* out = neuronmp_optrack::slot("aten::index.Tensor_out");
  return slot == out;
}

inline bool is_mask(const at::Tensor& t) {
  return t.scalar_type() == at::kBool || t.scalar_type() == at::kByte;
}

// The indices are the op's second argument (Tensor?[]).
template <typename Alias>
void record(neuronmp_optrack::Slot* slot, const torch::jit::Stack& stack, size_t base,
            Alias&& alias) {
  static auto* nonzero = neuronmp_optrack::slot("aten::nonzero");
  bool empty_arg = stack[base].isTensor() && stack[base].toTensor().numel() == 0;
  bool selects_nothing = false;
  const auto& v = stack[base + 1];
  if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      if (!e.isTensor() || !e.toTensor().defined()) continue;
      const at::Tensor& t = e.toTensor();
      const bool on = t.device().type() == c10::DeviceType::PrivateUse1;
      if (on && is_mask(t)) neuronmp_optrack::hit(nonzero);
      if (t.numel() == 0) {
        empty_arg = true;
      } else if (is_mask(t) && !selects_nothing) {
        selects_nothing = !(on ? alias(t) : t).any().template item<bool>();
      }
    }
  }
  if (empty_arg || !selects_nothing) neuronmp_optrack::hit(slot);
}

template <at::Tensor (*Alias)(const at::Tensor&)>
void index_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto* p = neuronmp_optrack::slot_of(op);
  neuronmp_optrack::check_placement(p, op, *stack);
  const size_t base = stack->size() - op.schema().arguments().size();
  if (neuronmp_optrack::tls_depth == 0) record(p, *stack, base, Alias);
  neuronmp_optrack::Depth d;
  op.callBoxedForDispatchKey(
      op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd)
          ? c10::DispatchKey::CompositeExplicitAutograd
          : c10::DispatchKey::CompositeExplicitAutogradNonFunctional,
      *stack);
}

}  // namespace neuronmp_indexing
