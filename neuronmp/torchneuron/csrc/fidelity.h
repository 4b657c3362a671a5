// Trainium's refusals and numerics on the emulated device, where they differ from the
// CPU kernels the fallback runs (NEURONMP_TORCHNEURON_RELAXED=1 turns them all off):
//
//   before the CPU kernel   an op TorchNeuron has a device kernel for refuses complex
//                           tensors as its dtype conversion does (ValueError), a matmul
//                           refuses integer tensors but int16 as the Neuron compiler does
//                           (RuntimeError); float64 inputs of such an op are rounded to
//                           float32, the precision the device computes them in
//   after the CPU kernel    float64 outputs are rounded likewise; relu and the Scalar
//                           clamps give what the device's max/min give for NaN: the
//                           bound, not NaN; sign keeps NaN (the CPU gives 0); ceil and
//                           trunc of inf and NaN give -2^31 (the device converts through
//                           int32; float16, which cannot hold it, keeps the CPU's)
//
// An op's rule is worked out once, from its name, and kept in its op-tracking slot; the
// checks walk the arguments (a dtype compare each) only for ops that have a rule or a
// device kernel.
#pragma once

#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <string>

#include "optrack.h"

namespace neuronmp_fidelity {

inline std::atomic<bool> g_relaxed{false};

enum Rule : int { kNone = 0, kMatmul, kRelu, kClamp, kClampMin, kClampMax, kSign,
                  kThroughInt32 };

inline Rule rule_for(const std::string& full) {
  // full is aten::name or aten::name.overload; the Tensor overloads of the clamps keep
  // the CPU's NaN (their bound is a tensor, not a value to put in its place)
  const auto dot = full.find('.');
  const std::string base = full.substr(0, dot);
  const std::string overload = dot == std::string::npos ? "" : full.substr(dot + 1);
  static const char* matmuls[] = {"aten::mm", "aten::bmm", "aten::addmm", "aten::addmm_",
                                  "aten::baddbmm", "aten::baddbmm_", "aten::addbmm",
                                  "aten::addbmm_", "aten::dot", "aten::vdot", "aten::mv",
                                  "aten::addmv", "aten::addmv_"};
  for (const char* m : matmuls)
    if (base == m) return kMatmul;
  if (overload == "Tensor" || overload == "Tensor_out") return kNone;
  if (base == "aten::relu" || base == "aten::relu_") return kRelu;
  if (base == "aten::clamp" || base == "aten::clamp_") return kClamp;
  if (base == "aten::clamp_min" || base == "aten::clamp_min_") return kClampMin;
  if (base == "aten::clamp_max" || base == "aten::clamp_max_") return kClampMax;
  if (base == "aten::sign" || base == "aten::sign_") return kSign;
  if (base == "aten::ceil" || base == "aten::ceil_" || base == "aten::trunc" ||
      base == "aten::trunc_")
    return kThroughInt32;
  return kNone;
}

inline Rule rule_of(neuronmp_optrack::Slot* slot) {
  int r = slot->rule.load(std::memory_order_relaxed);
  if (r < 0) {
    r = rule_for(slot->full);
    slot->rule.store(r, std::memory_order_relaxed);
  }
  return static_cast<Rule>(r);
}

// dtypes as Python prints them (torch.float32), for messages TorchNeuron words that way
inline std::string py_name(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "torch.float32";
    case c10::ScalarType::Double: return "torch.float64";
    case c10::ScalarType::Half: return "torch.float16";
    case c10::ScalarType::BFloat16: return "torch.bfloat16";
    case c10::ScalarType::ComplexFloat: return "torch.complex64";
    case c10::ScalarType::ComplexDouble: return "torch.complex128";
    case c10::ScalarType::ComplexHalf: return "torch.complex32";
    case c10::ScalarType::Int: return "torch.int32";
    case c10::ScalarType::Long: return "torch.int64";
    case c10::ScalarType::Short: return "torch.int16";
    case c10::ScalarType::Char: return "torch.int8";
    case c10::ScalarType::Byte: return "torch.uint8";
    case c10::ScalarType::Bool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(t);
  }
}

// What one call of an op must do beyond the CPU's kernel; decided before it runs.
struct Plan {
  Rule rule = kNone;
  bool device_kernel = false;   // TorchNeuron has a device kernel for it
  bool round64 = false;         // float64 tensors are computed at float32
  double nan_value = 0.0;       // relu / clamp: what NaN becomes
  bool nan_fill = false;
  at::Tensor nan_in;            // sign: where its input was NaN (taken before it runs)

  bool post() const { return round64 || nan_fill || rule == kSign || rule == kThroughInt32; }
};

inline bool has_value(const c10::IValue& v) { return !v.isNone(); }

// Refusals, and the plan for the rest.  `tensors` calls f(tensor) for every tensor argument.
template <typename ForTensors>
Plan plan(neuronmp_optrack::Slot* slot, const c10::OperatorName& name,
          const torch::jit::Stack& stack, size_t base, ForTensors&& tensors) {
  Plan p;
  if (g_relaxed.load(std::memory_order_relaxed)) return p;
  p.device_kernel = slot->kind.load(std::memory_order_relaxed) != neuronmp_optrack::kFallback;
  p.rule = rule_of(slot);
  if (!p.device_kernel && p.rule == kNone) return p;
  tensors([&](const at::Tensor& t) {
    const auto st = t.scalar_type();
    if (p.device_kernel && c10::isComplexType(st))
      TORCH_CHECK_VALUE(false, "Unsupported PyTorch dtype: ", py_name(st), " (", name,
                        " on the neuron device, which has no complex kernels; "
                        "NEURONMP_TORCHNEURON_RELAXED=1 runs it with the CPU's)");
    // int16 is not refused: TorchNeuron's tests run linear of int16 tensors on the
    // device and compare it exactly with the CPU's (the compiler's refusal names the
    // 32- and 64-bit integers; its tests expect int8 refused too)
    if (p.rule == kMatmul && c10::isIntegralType(st, /*includeBool=*/true) &&
        st != c10::ScalarType::Short)
      TORCH_CHECK(false, "Execution failed: NEFF compilation failed: ", name, " of ",
                  py_name(st), " tensors: Internal tensorizer error: "
                  "LegalizeType:int64/uint64/int32/uint32 matmult is not supported! (the "
                  "Neuron compiler multiplies float32, float16 and bfloat16 matrices; "
                  "NEURONMP_TORCHNEURON_RELAXED=1 runs it with the CPU's kernel)");
    if (p.device_kernel && st == c10::ScalarType::Double) p.round64 = true;
  });
  const auto scalar = [&](size_t i) {
    const auto& v = stack[base + i];
    return has_value(v) ? std::optional<double>(v.toScalar().toDouble()) : std::nullopt;
  };
  std::optional<double> fill;
  switch (p.rule) {
    case kRelu: fill = 0.0; break;
    case kClamp: fill = scalar(1) ? scalar(1) : scalar(2); break;
    case kClampMin:
    case kClampMax: fill = scalar(1); break;
    default: break;
  }
  if (fill) {
    p.nan_fill = true;
    p.nan_value = *fill;
  }
  return p;
}

// float64 at the device's float32 precision, in place
inline void round_to_float32(const at::Tensor& t) {
  if (t.defined() && t.scalar_type() == c10::ScalarType::Double && t.numel() > 0)
    const_cast<at::Tensor&>(t).copy_(t.to(c10::ScalarType::Float));
}

// a float64 input's rounded copy (the device reads it as float32)
inline at::Tensor rounded_input(const at::Tensor& t) {
  return t.to(c10::ScalarType::Float).to(c10::ScalarType::Double);
}

// What the device gives where the CPU's kernel gave `out`, in place.
inline void finish(const Plan& p, const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return;
  if (p.round64) round_to_float32(t);
  if (!c10::isFloatingType(t.scalar_type())) return;
  auto& out = const_cast<at::Tensor&>(t);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  if (p.nan_fill) {
    out.nan_to_num_(p.nan_value, inf, -inf);
  } else if (p.rule == kSign && p.nan_in.defined() && p.nan_in.sizes() == out.sizes()) {
    out.masked_fill_(p.nan_in, nan);
  } else if (p.rule == kThroughInt32 && t.scalar_type() != c10::ScalarType::Half) {
    out.masked_fill_(out.isfinite().logical_not_(), -2147483648.0);
  }
}

}  // namespace neuronmp_fidelity
