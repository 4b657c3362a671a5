// Op tracking: which aten ops ran on the device and which would have fallen back to the
// CPU on TorchNeuron (torch_neuronx.get_executed_ops / get_fallback_ops).
//
//   configure(device, unrecorded)   from Python once the extension loads: TorchNeuron's
//                                   device kernels (neuronmp/torchneuron/coverage.py:
//                                   overload -> the name it records, "" = records nothing)
//   a slot per op                   executed / fallback / silent, its recorded name, and
//                                   the generation it was last recorded in (a clear
//                                   starts a new generation: one lock-free test per op)
//   device kernels torch composes   (CompositeExplicit / CompositeImplicit ops such as
//                                   _to_copy, copy_, linear) get a kernel that records
//                                   them and runs the composite; the compute ops it
//                                   dispatches are not recorded (TorchNeuron runs the
//                                   whole op), its allocations are (so are TorchNeuron's)
//   device kernels in Python        enter()/leave() around their body: the same, and
//                                   recorded even when another kernel calls them
#pragma once

#include <torch/library.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace neuronmp_optrack {

enum Kind : int { kSilent = 0, kExecuted = 1, kFallback = 2 };

struct Slot {
  std::string full;                 // aten::name.overload
  std::string recorded;             // the name the lists show
  std::atomic<int> kind{kFallback};
  std::atomic<uint64_t> gen{0};
  std::atomic<int> rule{-1};        // fidelity.h's rule for it, -1 until first asked
};

struct State {
  std::mutex mu;
  std::unordered_map<std::string, std::string> device;  // overload -> recorded ("" silent)
  std::unordered_set<std::string> unrecorded;
  std::unordered_map<std::string, std::unique_ptr<Slot>> slots;
  std::unordered_map<const void*, Slot*> by_schema;
  std::unordered_set<std::string> executed, fallback;
  std::atomic<uint64_t> gen{1};
  std::vector<torch::Library*> libraries;  // leaked: registrations live as long as the process
};

inline State& state() {
  static State* s = new State();  // leaked: outlives static destruction at exit
  return *s;
}

inline thread_local int tls_depth = 0;  // > 0 inside a recorded composite device kernel

inline void classify(State& s, Slot& slot) {
  auto it = s.device.find(slot.full);
  if (it != s.device.end()) {
    slot.recorded = it->second;
    slot.kind = it->second.empty() ? kSilent : kExecuted;
  } else if (s.unrecorded.count(slot.full)) {
    slot.recorded.clear();
    slot.kind = kSilent;
  } else {
    slot.recorded = slot.full;
    slot.kind = kFallback;
  }
}

inline Slot* slot_locked(State& s, const std::string& full) {
  auto& p = s.slots[full];
  if (!p) {
    p = std::make_unique<Slot>();
    p->full = full;
    classify(s, *p);
  }
  return p.get();
}

inline Slot* slot(const std::string& full) {
  auto& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  return slot_locked(s, full);
}

inline Slot* slot_of(const c10::OperatorHandle& op) {
  auto& s = state();
  const void* key = &op.schema();
  std::lock_guard<std::mutex> g(s.mu);
  auto it = s.by_schema.find(key);
  if (it != s.by_schema.end()) return it->second;
  Slot* p = slot_locked(s, c10::toString(op.schema().operator_name()));
  s.by_schema.emplace(key, p);
  return p;
}

// A direct kernel's call (allocation, resize) is recorded even inside a composite device
// kernel: TorchNeuron's kernels allocate their outputs through the dispatcher too.
inline void hit_always(Slot* p) {
  const int kind = p->kind.load(std::memory_order_relaxed);
  if (kind == kSilent) return;
  auto& s = state();
  const uint64_t now = s.gen.load(std::memory_order_acquire);
  if (p->gen.load(std::memory_order_relaxed) == now) return;
  std::lock_guard<std::mutex> g(s.mu);
  (p->kind == kExecuted ? s.executed : s.fallback).insert(p->recorded);
  p->gen.store(s.gen.load(), std::memory_order_relaxed);
}

inline void hit(Slot* p) {
  if (tls_depth == 0) hit_always(p);
}

// One slot per call site: the static is filled on first use.
#define NEURONMP_OPTRACK(full)                                                  \
  do {                                                                         \
    static ::neuronmp_optrack::Slot* _slot = ::neuronmp_optrack::slot(full);   \
    ::neuronmp_optrack::hit_always(_slot);                                     \
  } while (0)

struct Depth {
  Depth() { ++tls_depth; }
  ~Depth() { --tls_depth; }
};

// A device kernel that is one op to TorchNeuron (copy_): recorded unless a composite
// kernel called it, and the ops it calls inside (all but allocations) are that one op.
#define NEURONMP_OPTRACK_WHOLE(full)                                            \
  static ::neuronmp_optrack::Slot* _whole_slot = ::neuronmp_optrack::slot(full); \
  ::neuronmp_optrack::hit(_whole_slot);                                         \
  ::neuronmp_optrack::Depth _whole_depth

// A cast on the device between dtypes of 32 bits or fewer is TorchNeuron's MLIR cast
// kernel, which records itself as aten::copy_ even inside _to_copy (a 64-bit one goes
// through the host and records nothing).
inline void hit_device_cast(const at::Tensor& self, const at::Tensor& src) {
  static Slot* copy = slot("aten::copy_");
  if (tls_depth == 0 || self.scalar_type() == src.scalar_type()) return;
  const auto on = [](const at::Tensor& t) {
    return t.device().type() == c10::DeviceType::PrivateUse1 && c10::elementSize(t.scalar_type()) <= 4;
  };
  if (on(self) && on(src)) hit_always(copy);
}

// TorchNeuron's Python device kernels look at where each argument lives before they
// run and refuse a tensor of one or more dimensions off the device, naming it as Python
// received it: a positional argument by index, a list's element by both indices, a
// keyword-only one by name (its message has no space before "device").  Only the op the
// caller called checks (not those a composite kernel calls inside), and only when a
// tensor argument is on the device; the indices of index / index_put_ (Tensor?[]) may
// stay on the CPU, as that kernel accepts them.
inline void check_placement(const Slot* p, const c10::OperatorHandle& op,
                            const torch::jit::Stack& stack) {
  if (tls_depth != 0 || p->kind.load(std::memory_order_relaxed) != kExecuted) return;
  const auto& args = op.schema().arguments();
  const size_t base = stack.size() - args.size();
  auto on = [](const at::Tensor& t) {
    return t.defined() && t.device().type() == c10::DeviceType::PrivateUse1;
  };
  auto off = [](const at::Tensor& t) {
    return t.defined() && t.dim() != 0 && t.device().type() != c10::DeviceType::PrivateUse1;
  };
  // a CPU tensor sent to the device by a device argument (_to_copy) is what that
  // kernel is for: only a call with a device tensor among its tensors is checked
  bool any_on = false;
  for (size_t i = base; i < stack.size() && !any_on; ++i) {
    if (stack[i].isTensor()) {
      any_on = on(stack[i].toTensor());
    } else if (stack[i].isTensorList()) {
      for (const at::Tensor t : stack[i].toTensorList()) any_on = any_on || on(t);
    }
  }
  if (!any_on) return;
  auto where = [](const at::Tensor& t) { return c10::DeviceTypeName(t.device().type(), true); };
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& v = stack[base + i];
    if (args[i].kwarg_only()) {
      if (v.isTensor() && off(v.toTensor()))
        TORCH_CHECK(false, "Non-scalar tensor kwarg '", args[i].name(), "' is on ",
                    where(v.toTensor()), "device, expected neuron");
    } else if (v.isTensor()) {
      if (off(v.toTensor()))
        TORCH_CHECK(false, "Non-scalar tensor arg", i, " is on ", where(v.toTensor()),
                    " device, expected neuron");
    } else if (v.isTensorList()) {
      const auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j)
        if (off(list.get(j)))
          TORCH_CHECK(false, "Non-scalar tensor arg", i, "[", j, "] is on ", where(list.get(j)),
                      " device, expected neuron");
    }
  }
}

// A device kernel written in Python (torch.library) is entered and left around its body:
// it is recorded as itself even when another kernel called it (on TorchNeuron each such
// kernel is reached through the dispatcher and records itself), and the ops its body runs
// are that one op, as the compiled kernel is one op there (allocations aside, as above).
inline void enter(const std::string& full) {
  hit_always(slot(full));
  ++tls_depth;
}

inline void leave() {
  if (tls_depth > 0) --tls_depth;
}

inline void composite_explicit(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  Slot* p = slot_of(op);
  check_placement(p, op, *stack);
  hit(p);
  Depth d;
  op.callBoxedForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd, *stack);
}

inline void composite_explicit_nf(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  Slot* p = slot_of(op);
  check_placement(p, op, *stack);
  hit(p);
  Depth d;
  op.callBoxedForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional, *stack);
}

inline void composite_implicit(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  Slot* p = slot_of(op);
  check_placement(p, op, *stack);
  hit(p);
  Depth d;
  op.callBoxedForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd, *stack);
}

// Device kernels of ops torch composes: register a recording kernel for each, once.
inline void register_composites(State& s) {
  if (!s.libraries.empty()) return;
  auto* backend = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                     __FILE__, __LINE__);
  auto* autograd = new torch::Library(torch::Library::IMPL, "aten",
                                      c10::DispatchKey::AutogradPrivateUse1, __FILE__, __LINE__);
  s.libraries = {backend, autograd};
  auto& d = c10::Dispatcher::singleton();
  for (const auto& kv : s.device) {
    const auto& full = kv.first;
    const auto dot = full.find('.');
    const std::string base = full.substr(6, dot == std::string::npos ? std::string::npos : dot - 6);
    const std::string overload = dot == std::string::npos ? "" : full.substr(dot + 1);
    auto op = d.findSchema(c10::OperatorName("aten::" + base, overload));
    if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) continue;
    const std::string spec = overload.empty() ? base : base + "." + overload;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd)) {
      backend->impl(spec.c_str(), torch::CppFunction::makeFromBoxedFunction<&composite_explicit>());
    } else if (op->hasKernelForDispatchKey(
                   c10::DispatchKey::CompositeExplicitAutogradNonFunctional)) {
      backend->impl(spec.c_str(),
                    torch::CppFunction::makeFromBoxedFunction<&composite_explicit_nf>());
    } else if (op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) &&
               !op->hasKernelForDispatchKey(c10::DispatchKey::AutogradPrivateUse1)) {
      // One torch has a derivative for (linear: linear_backward) gets a backend kernel,
      // as TorchNeuron's is: autograd then records that derivative, not the one of the
      // ops the composite is made of.  Without one, the kernel sits above autograd and
      // the composite's ops carry the gradient.
      auto* lib = op->hasKernelForDispatchKey(c10::DispatchKey::Autograd) ? backend : autograd;
      lib->impl(spec.c_str(), torch::CppFunction::makeFromBoxedFunction<&composite_implicit>());
    }
  }
}

inline void configure(const std::unordered_map<std::string, std::string>& device,
                      const std::vector<std::string>& unrecorded) {
  auto& s = state();
  {
    std::lock_guard<std::mutex> g(s.mu);
    s.device = device;
    s.unrecorded = std::unordered_set<std::string>(unrecorded.begin(), unrecorded.end());
    for (auto& kv : s.slots) classify(s, *kv.second);
  }
  register_composites(s);
}

inline void record(const std::string& name, bool executed) {
  auto& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  (executed ? s.executed : s.fallback).insert(name);
}

inline std::vector<std::string> listed(bool executed) {
  auto& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  const auto& set = executed ? s.executed : s.fallback;
  return std::vector<std::string>(set.begin(), set.end());
}

inline void clear() {
  auto& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  s.executed.clear();
  s.fallback.clear();
  s.gen.fetch_add(1, std::memory_order_acq_rel);
}

}  // namespace neuronmp_optrack
