// The `neuron` device's C++ half: what torch 2.13 does not let Python provide.
//
//   device guard   deviceCount = the process's visible logical cores; a thread-local
//                  current device and current stream; new streams are the default
//                  stream unless NEURON_RT_ENABLE_HOST_CC=1, as in TorchNeuron; events
//                  carry a host timestamp
//   allocator      host memory per device index, counted per device (the memory
//                  statistics); first use starts the runtime (a Python callback);
//                  blocks of kSharedMin bytes or more are each a memfd mapped
//                  MAP_SHARED, so the ranks of a process group can map each
//                  other's tensors (shared_block says where one lives)
//   hooks          PrivateUse1 hooks: availability, pinned host memory, generators
//   kernels        empty/empty_strided/copy/views/resize/set_ over that memory, and
//                  one boxed fallback: every other op runs the CPU kernel on CPU
//                  aliases of the same memory, fresh outputs adopted without a copy
//   autocast       AutocastPrivateUse1 with the CUDA policy lists
//   fidelity       fidelity.h: Trainium's refusals (complex, integer matmul) and
//                  numerics (float64 at float32, NaN and inf through a few ops) in the
//                  fallback
//   op tracking    optrack.h: each op is recorded once per clear as executed (TorchNeuron
//                  has a device kernel for it) or fallen back (it has none); indexing.h:
//                  what aten::index lists
//
// Compiled on first use by neuronmp/torchneuron/_ext.py (torch.utils.cpp_extension.load).
#include <torch/extension.h>
#include <torch/csrc/Event.h>
#include <torch/csrc/Generator.h>
#include <torch/library.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <deque>
#include <limits>
#include <mutex>
#include <pthread.h>
#include <unordered_set>

#include "fidelity.h"
#include "indexing.h"
#include "optrack.h"

namespace neuronmp_device {

using c10::DeviceIndex;
constexpr c10::DeviceType kNeuron = c10::DeviceType::PrivateUse1;
// torch numbers devices with an int8 (DeviceIndex): neuron:0 .. neuron:127
constexpr int kMaxDevices = std::numeric_limits<DeviceIndex>::max() + 1;

// ---------------------------------------------------------------- process state

std::atomic<int> g_count{0};         // visible logical cores (set from Python)
std::atomic<bool> g_ready{false};    // the runtime holds the cores
std::atomic<bool> g_bad_fork{false}; // forked after the runtime started
// The current device is thread-local; a thread that never set one gets the process
// default: the first device any thread set (TorchNeuron's rule), a rank's own device
// once attach_rank ran, else neuron:0.
std::atomic<DeviceIndex> g_default_device{-1};
// A rank of a distributed job numbers devices as TorchNeuron does there: device_count
// is the local world size and only neuron:<local rank> is this process's.
std::atomic<int> g_own{-1};  // the one index this process owns, -1: all of them
thread_local DeviceIndex tls_device = -1;
pybind11::object* g_init = nullptr;  // leaked on purpose: outlives interpreter teardown

// TorchNeuron's per-device counters: bytes held now, their peak, bytes ever
// allocated and freed, allocation requests (zero-byte ones too) and frees.
struct Stats {
  std::atomic<int64_t> current{0}, peak{0}, allocated{0}, freed{0}, requests{0}, frees{0};
};
Stats g_stats[kMaxDevices];

void check_index(int64_t index) {
  const int n = g_count.load();
  TORCH_CHECK(index >= 0 && index < n, "Device index ", index,
              " is out of range. Valid range is 0 to ", n - 1, " for this process",
              index >= kMaxDevices ? " (torch keeps a device index in 8 bits: neuron:128 and "
                                     "above cannot be named)" : "");
  const int own = g_own.load();
  TORCH_CHECK(own < 0 || index == own, "Attempted to access device that doesn't attach to "
              "this process: neuron:", index, " (this rank's device is neuron:", own, ")");
}

// A c10::Device keeps its index in 8 bits, so neuron:128 arrives as -128; torch refuses
// a negative index from the user, so one below -1 is such a wrap of the index asked for.
void check_device(DeviceIndex index) {
  check_index(index < -1 ? int64_t{index} + 256 : int64_t{index});
}

DeviceIndex current_device() {
  if (tls_device >= 0) return tls_device;
  const DeviceIndex d = g_default_device.load(std::memory_order_acquire);
  return d >= 0 ? d : 0;
}

void set_current_device(DeviceIndex d) {
  tls_device = d;
  DeviceIndex unset = -1;  // only the process's first set_device becomes its default
  g_default_device.compare_exchange_strong(unset, d, std::memory_order_acq_rel);
}

// The runtime starts at first device use (TorchNeuron's lazy init): reserving the
// visible cores, refusing a forked child.  Python raises the error that applies.
void ensure_ready() {
  if (g_ready.load(std::memory_order_acquire)) return;
  pybind11::gil_scoped_acquire gil;
  TORCH_CHECK(g_init != nullptr, "neuron device used before neuronmp registered it");
  (*g_init)();
}

void count_alloc(DeviceIndex d, int64_t n) {
  auto& s = g_stats[d];
  const int64_t now = s.current.fetch_add(n) + n;
  int64_t peak = s.peak.load();
  while (now > peak && !s.peak.compare_exchange_weak(peak, now)) {}
  s.requests++;
  s.allocated += n;
}

void count_free(DeviceIndex d, int64_t n) {
  g_stats[d].current.fetch_sub(n);
  g_stats[d].freed += n;
  g_stats[d].frees++;
}

// ---------------------------------------------------------------- allocators

struct Block {
  void* ptr;
  int64_t size;
  DeviceIndex device;
  c10::Storage adopted;  // set when the memory came from a CPU kernel's output
  int fd = -1;           // the memfd behind a shared block, else -1
  uint64_t serial = 0;   // names the memfd: a peer checks it is still this block
  size_t mapped = 0;     // bytes mapped (the size rounded up to whole pages)
};

// Blocks this big or bigger are shareable: big enough that a collective's saved copy
// outweighs the file descriptor and mapping each one costs, and few enough (a model's
// parameters, gradient buckets, activations) to stay well inside the fd limit.
constexpr size_t kSharedMin = size_t(1) << 20;
std::atomic<uint64_t> g_serial{0};
std::atomic<bool> g_share{true};  // off after a memfd failed: plain memory from then on

// A memfd of n bytes mapped MAP_SHARED, or nullptr (the caller falls back to plain
// memory): the memory dies with the last mapping and descriptor, so a killed process
// leaves nothing behind, unlike a named file.
void* alloc_shared(size_t n, Block* b) {
  const uint64_t serial = ++g_serial;
  char name[40];
  std::snprintf(name, sizeof name, "neuronmp-%llu", static_cast<unsigned long long>(serial));
  const int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) {
    g_share = false;
    return nullptr;
  }
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t len = (n + page - 1) / page * page;
  void* p = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(len)) == 0)
    p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    return nullptr;
  }
  b->fd = fd;
  b->serial = serial;
  b->mapped = len;
  return p;
}

void free_block(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  count_free(b->device, b->size);
  if (b->fd >= 0) {
    munmap(b->ptr, b->mapped);
    close(b->fd);
  } else if (!b->adopted) {
    c10::free_cpu(b->ptr);
  }
  delete b;
}

struct NeuronAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    ensure_ready();
    const DeviceIndex d = current_device();
    check_index(d);
    if (n == 0) {  // a request, but no memory to count or free
      g_stats[d].requests++;
      return {nullptr, c10::Device(kNeuron, d)};
    }
    auto* b = new Block{nullptr, static_cast<int64_t>(n), d, {}};
    void* p = n >= kSharedMin && g_share.load(std::memory_order_relaxed)
                  ? alloc_shared(n, b) : nullptr;
    if (p == nullptr) p = c10::alloc_cpu(n);
    b->ptr = p;
    count_alloc(d, static_cast<int64_t>(n));
    return {p, b, &free_block, c10::Device(kNeuron, d)};
  }
  void copy_data(void* dst, const void* src, std::size_t n) const override {
    default_copy_data(dst, src, n);
  }
};
NeuronAllocator g_allocator;
REGISTER_ALLOCATOR(kNeuron, &g_allocator);

std::mutex g_pinned_mu;
std::unordered_set<const void*> g_pinned;

void free_pinned(void* p) {
  {
    std::lock_guard<std::mutex> l(g_pinned_mu);
    g_pinned.erase(p);
  }
  c10::free_cpu(p);
}

// Page-locked host memory is plain host memory here; what matters to torch is that
// is_pinned() answers for it.
struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = n ? c10::alloc_cpu(n) : nullptr;
    if (p) {
      std::lock_guard<std::mutex> l(g_pinned_mu);
      g_pinned.insert(p);
    }
    return {p, p, &free_pinned, c10::Device(c10::kCPU)};
  }
  void copy_data(void* dst, const void* src, std::size_t n) const override {
    default_copy_data(dst, src, n);
  }
};
PinnedAllocator g_pinned_allocator;

// ---------------------------------------------------------------- generators

// TorchNeuron's generator: a seed and a Philox offset, 16 bytes of state.  Random ops
// do not draw from it: they run the CPU's kernels with the CPU's default generator, as
// TorchNeuron's CPU fallback runs them, so torch.manual_seed decides their numbers.
struct NeuronGenerator final : c10::GeneratorImpl {
  explicit NeuronGenerator(DeviceIndex d)
      : c10::GeneratorImpl(c10::Device(kNeuron, d),
                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)) {}
  void set_current_seed(uint64_t s) override {
    seed_ = s;
    offset_ = 0;
  }
  void set_offset(uint64_t o) override { offset_ = o; }
  uint64_t get_offset() const override { return offset_; }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override {
    const auto s = c10::detail::getNonDeterministicRandom(true);
    set_current_seed(s);
    return s;
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto t = at::detail::empty_cpu({16}, at::ScalarType::Byte, std::nullopt, std::nullopt,
                                   std::nullopt, std::nullopt);
    auto* p = static_cast<uint8_t*>(t.data_ptr());
    const auto off = static_cast<int64_t>(offset_);
    std::memcpy(p, &seed_, 8);
    std::memcpy(p + 8, &off, 8);
    return t.getIntrusivePtr();
  }
  void set_state(const c10::TensorImpl& st) override {
    const auto n = st.numel();
    TORCH_CHECK(n == 16 || n == 8, "RNG state is wrong size");  // 8: a seed alone
    const auto* p = static_cast<const uint8_t*>(st.data());
    std::memcpy(&seed_, p, 8);
    int64_t off = 0;
    if (n == 16) std::memcpy(&off, p + 8, 8);
    offset_ = static_cast<uint64_t>(off);
  }
  static c10::DeviceType device_type() { return kNeuron; }

 private:
  NeuronGenerator* clone_impl() const override {
    auto* g = new NeuronGenerator(device_.index());
    g->seed_ = seed_;
    g->offset_ = offset_;
    return g;
  }
  uint64_t seed_ = c10::default_rng_seed_val;
  uint64_t offset_ = 0;
};

std::mutex g_gen_mu;
std::deque<at::Generator> g_gens;  // a deque: growing it keeps references valid

// Each device's default generator, seeded at random when first asked for, as
// TorchNeuron seeds it (torch.manual_seed seeds them all).
at::Generator& generator(DeviceIndex d) {
  check_index(d);
  std::lock_guard<std::mutex> l(g_gen_mu);
  for (size_t i = g_gens.size(); i <= static_cast<size_t>(d); ++i) {
    g_gens.push_back(at::make_generator<NeuronGenerator>(static_cast<DeviceIndex>(i)));
    g_gens.back().seed();
  }
  return g_gens[d];
}

// ---------------------------------------------------------------- guard

struct Event {
  std::chrono::steady_clock::time_point when;
  bool recorded = false;
};

// Streams as TorchNeuron numbers them.  Without HostCC every stream made is the
// device's default stream (id 0); with NEURON_RT_ENABLE_HOST_CC=1, read once when the
// first stream is made, as TorchNeuron reads it, each new stream gets an id of its own:
// a pool index (round robin over 8), the priority's two bits and a per-device counter.
// Work is synchronous either way, so an id is all a stream is; the current stream is
// per thread and per device.
constexpr int kStreamPools = 8;
std::atomic<uint32_t> g_stream_pool{0};
std::atomic<uint32_t> g_stream_counter[kMaxDevices];
thread_local c10::StreamId tls_stream[kMaxDevices] = {};

bool host_cc() {
  static const bool on = [] {
    const char* v = std::getenv("NEURON_RT_ENABLE_HOST_CC");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

DeviceIndex stream_device(c10::Device d) {
  const DeviceIndex i = d.has_index() ? d.index() : current_device();
  check_device(i);
  return i;
}

c10::Stream new_stream(c10::Device d, int priority) {
  const DeviceIndex i = stream_device(d);
  const c10::Device dev(kNeuron, i);
  if (!host_cc()) return c10::Stream(c10::Stream::DEFAULT, dev);
  const uint32_t pool = g_stream_pool.fetch_add(1) % kStreamPools;
  const uint32_t counter = g_stream_counter[i].fetch_add(1) + 1;
  const auto id = (static_cast<c10::StreamId>(counter) << 5) |
                  (static_cast<c10::StreamId>(priority & 3) << 3) | pool;
  return c10::Stream(c10::Stream::UNSAFE, dev, id);
}

c10::Stream current_stream(c10::Device d) {
  const DeviceIndex i = d.has_index() ? d.index() : current_device();
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kNeuron, i),
                     i >= 0 ? tls_stream[i] : 0);
}

c10::Stream exchange_stream(c10::Stream s) {
  const auto old = current_stream(s.device());
  if (s.device_index() >= 0) tls_stream[s.device_index()] = s.id();
  return old;
}

struct NeuronGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNeuron; }
  c10::Device exchangeDevice(c10::Device d) const override {
    const auto old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return {kNeuron, current_device()}; }
  void setDevice(c10::Device d) const override {
    check_device(d.index());
    set_current_device(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    set_current_device(d.index());
  }
  c10::Stream getStream(c10::Device d) const noexcept override { return current_stream(d); }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kNeuron, stream_device(d)));
  }
  c10::Stream getNewStream(c10::Device d, int priority) const override {
    return new_stream(d, priority);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high) const override {
    return new_stream(d, high ? -1 : 0);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    return exchange_stream(s);
  }
  DeviceIndex deviceCount() const noexcept override {
    return static_cast<DeviceIndex>(g_count.load());
  }
  void record(void** ev, const c10::Stream&, const DeviceIndex, const c10::EventFlag)
      const override {
    if (*ev == nullptr) *ev = new Event();
    auto* e = static_cast<Event*>(*ev);
    e->when = std::chrono::steady_clock::now();  // work is done when it is enqueued
    e->recorded = true;
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void* ev, const DeviceIndex) const noexcept override {
    delete static_cast<Event*>(ev);
  }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  double elapsedTime(void* a, void* b, const DeviceIndex) const override {
    auto* x = static_cast<Event*>(a);
    auto* y = static_cast<Event*>(b);
    TORCH_CHECK(x && y && x->recorded && y->recorded,
                "Both events must be recorded before calculating elapsed time.");
    return std::chrono::duration<double, std::milli>(y->when - x->when).count();
  }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, NeuronGuard);

// torch.neuron.Event's elapsed_time, with TorchNeuron's checks in its order and words
// (torch.Event's own come in another order, the timing one as a ValueError).
double event_elapsed(pybind11::handle start, pybind11::handle end) {
  TORCH_CHECK(THPEvent_Check(start.ptr()) && THPEvent_Check(end.ptr()),
              "Expected a Neuron event");
  const auto& a = reinterpret_cast<THPEvent*>(start.ptr())->event;
  const auto& b = reinterpret_cast<THPEvent*>(end.ptr())->event;
  TORCH_CHECK(a.device_type() == kNeuron && b.device_type() == kNeuron,
              "Expected a Neuron event");
  TORCH_CHECK(a.flag() == c10::EventFlag::BACKEND_DEFAULT,
              "Event was not created with timing enabled");
  TORCH_CHECK(b.flag() == c10::EventFlag::BACKEND_DEFAULT,
              "End event was not created with timing enabled");
  TORCH_CHECK(a.was_marked_for_recording(), "Event has not been recorded");
  TORCH_CHECK(b.was_marked_for_recording(), "End event has not been recorded");
  TORCH_CHECK(a.device_index() == b.device_index(), "Events must be on the same device");
  return NeuronGuard().elapsedTime(a.eventId(), b.eventId(), a.device_index());
}

// ---------------------------------------------------------------- hooks

struct NeuronHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return g_count.load() > 0; }
  const at::Generator& getDefaultGenerator(DeviceIndex d) const override {
    return generator(d < 0 ? current_device() : d);
  }
  at::Generator getNewGenerator(DeviceIndex d) const override {
    return at::make_generator<NeuronGenerator>(d);
  }
  at::Device getDeviceFromPtr(void*) const override { return {kNeuron, current_device()}; }
  bool isPinnedPtr(const void* p) const override {
    std::lock_guard<std::mutex> l(g_pinned_mu);
    return g_pinned.count(p) > 0;
  }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  bool hasPrimaryContext(DeviceIndex) const override { return g_ready.load(); }
  // As TorchNeuron resizes: a storage keeps its device, even at zero bytes (the CPU's
  // resize would leave it a CPU storage), and new memory comes from that device.
  void resizePrivateUse1Bytes(const c10::Storage& st, size_t n) const override {
    TORCH_CHECK(st.resizable(), "Cannot resize a non-resizable storage");
    auto* impl = st.unsafeGetStorageImpl();
    const size_t old = st.nbytes();
    if (old == n) return;
    const c10::Device dev = st.device();
    c10::DataPtr fresh(nullptr, dev);
    if (n > 0) {
      const c10::DeviceGuard guard(dev);
      fresh = g_allocator.allocate(n);
      if (old > 0 && st.data() != nullptr) std::memcpy(fresh.get(), st.data(), std::min(old, n));
    }
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(n);
  }
};

// ---------------------------------------------------------------- tensors

// A lazy conjugate or negation (x.conj(), torch._neg_view) is a bit on the tensor;
// the ops that see such a tensor (copy_, the views, mm ...) read the bit, so an alias
// carries it, and a view made from an alias gives it back.
void keep_math_bits(at::Tensor& out, const at::Tensor& from) {
  if (from.is_conj()) out._set_conj(true);
  if (from.is_neg()) out._set_neg(true);
}

// A CPU tensor over the same bytes, owning nothing: it lives only inside one op.  Its
// storage is resizable with the CPU allocator so that an out= kernel may grow it
// (Call::sync_written then moves the new memory to the device tensor).
at::Tensor cpu_alias(const at::Tensor& t) {
  const auto& st = t.storage();
  c10::Storage cst(c10::Storage::use_byte_size_t(), st.nbytes(),
                   c10::DataPtr(const_cast<void*>(st.data()), c10::Device(c10::kCPU)),
                   c10::GetCPUAllocator(), true);
  auto out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(cst), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(),
                                                    t.storage_offset());
  keep_math_bits(out, t);
  return out;
}

at::Tensor with_storage(c10::Storage st, const at::Tensor& like) {
  auto out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(st), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), like.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(),
                                                    like.storage_offset());
  keep_math_bits(out, like);
  return out;
}

// Memory a CPU kernel allocated becomes device memory on `d` without a copy.
c10::Storage adopt_storage(const c10::Storage& src, DeviceIndex d) {
  const int64_t n = static_cast<int64_t>(src.nbytes());
  void* p = const_cast<void*>(src.data());
  if (n == 0 || p == nullptr) {  // nothing to hold: counted as the allocator counts it
    g_stats[d].requests++;
    return c10::Storage(c10::Storage::use_byte_size_t(), 0,
                        c10::DataPtr(nullptr, c10::Device(kNeuron, d)), &g_allocator, true);
  }
  count_alloc(d, n);
  auto* b = new Block{p, n, d, src};
  return c10::Storage(c10::Storage::use_byte_size_t(), n,
                      c10::DataPtr(p, b, &free_block, c10::Device(kNeuron, d)), &g_allocator,
                      true);
}

at::Tensor adopt(const at::Tensor& cpu, DeviceIndex d) {
  return with_storage(adopt_storage(cpu.storage(), d), cpu);
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout,
                               std::optional<c10::Device> device, std::optional<bool> pin,
                               std::optional<c10::MemoryFormat> fmt) {
  NEURONMP_OPTRACK("aten::empty.memory_format");
  const auto dev = c10::device_or_default(device);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "neuron tensors are strided only");
  const c10::DeviceGuard guard(dev);
  return at::detail::empty_generic(size, &g_allocator,
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), fmt);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin) {
  NEURONMP_OPTRACK("aten::empty_strided");
  const auto dev = c10::device_or_default(device);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "neuron tensors are strided only");
  const c10::DeviceGuard guard(dev);
  return at::detail::empty_strided_generic(size, stride, &g_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  auto d = dst.is_cpu() ? dst : cpu_alias(dst);
  const auto s = self.is_cpu() ? self : cpu_alias(self);
  d.copy_(s, non_blocking);
  return dst;
}

// copy_ itself, not only _copy_from: torch's generic copy_ hands a device tensor to
// _copy_from, which the conjugate and negation fallbacks intercept to materialise the
// bit with a clone, which is a copy_ again: endless.  The CPU's copy_ on aliases that
// carry the bits materialises them as the CPU does.
at::Tensor& copy_(at::Tensor& self, const at::Tensor& src, bool non_blocking) {
  neuronmp_optrack::hit_device_cast(self, src);
  NEURONMP_OPTRACK_WHOLE("aten::copy_");
  const auto host = [](const at::Tensor& t) {
    return t.device().type() == kNeuron ? cpu_alias(t) : t;
  };
  auto d = host(self);
  d.copy_(host(src), non_blocking);
  return self;
}

// TorchNeuron's kernel: CPU to neuron only; an empty dst is resized (through the
// dispatcher, so resize_ is recorded), any other must have self's sizes already
at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  NEURONMP_OPTRACK("aten::_copy_from_and_resize");
  TORCH_CHECK(dst.defined(), "dst is undefined");
  TORCH_CHECK(self.defined(), "self is undefined");
  TORCH_CHECK(self.is_cpu() && dst.device().type() == kNeuron,
              "_copy_from_and_resize now only support copy from cpu tensor to neuron tensor, but "
              "got src tensor device is ", self.device(), " and dst device is ", dst.device());
  if (dst.numel() == 0) const_cast<at::Tensor&>(dst).resize_as_(self);
  TORCH_CHECK(self.sizes() == dst.sizes(),
              "_copy_from_and_resize now only support copy with same size, or dst.numel() == 0!");
  const_cast<at::Tensor&>(dst).copy_(self);
  return dst;
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  NEURONMP_OPTRACK("aten::_local_scalar_dense");
  return at::native::_local_scalar_dense_cpu(cpu_alias(self));
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size,
                      c10::SymIntArrayRef stride, std::optional<c10::SymInt> offset) {
  return at::native::as_strided_tensorimpl(
      self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride),
      offset ? std::optional<int64_t>(offset->expect_int()) : std::nullopt);
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size,
                         c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size),
                                    C10_AS_INTARRAYREF_SLOW(stride));
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<at::MemoryFormat> fmt) {
  NEURONMP_OPTRACK("aten::resize_");
  const c10::DeviceGuard guard(self.device());
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), fmt);
}

// CPU and device tensors may stand in for each other's TensorImpl (as CUDA's do), so
// module.to("neuron") moves each Parameter's data in place: an optimizer built before
// the move keeps training the module's own parameters.
bool compatible_shallow_copy(const at::Tensor& self, const at::Tensor& from) {
  NEURONMP_OPTRACK("aten::_has_compatible_shallow_copy_type");
  const auto a = self.device().type(), b = from.device().type();
  return a == b || (a == c10::kCPU && b == kNeuron) || (a == kNeuron && b == c10::kCPU);
}

// Every op has finished when it returns and freed memory is not reused for another
// stream's work, so there is nothing to defer: only the arguments are checked.
void record_stream(at::Tensor& self, c10::Stream s) {
  NEURONMP_OPTRACK("aten::record_stream");
  TORCH_CHECK(self.device().type() == kNeuron,
              "record_stream: expected neuron tensor, but got: ", self.device());
  TORCH_CHECK(s.device_type() == kNeuron,
              "record_stream: expected neuron stream, but got device type: ", s.device_type());
}

// TorchNeuron's set_ kernels name the side that is off the device, in their words
at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& src) {
  NEURONMP_OPTRACK("aten::set_.source_Tensor");
  TORCH_CHECK(self.device().type() == kNeuron,
              "set_: expected neuron tensor, but got tensor on device ", self.device());
  TORCH_CHECK(src.device().type() == kNeuron,
              "set_: expected neuron source tensor, but got tensor on device ", src.device());
  return at::native::set_tensor_(self, src);
}

at::Tensor& set_storage(at::Tensor& self, at::Storage src) {
  NEURONMP_OPTRACK("aten::set_.source_Storage");
  TORCH_CHECK(src.device_type() == kNeuron,
              "set_: expected neuron storage, but got storage on device ", src.device_type());
  return at::native::set_(self, src);
}

at::Tensor& set_storage_offset(at::Tensor& self, at::Storage src, int64_t offset,
                               c10::IntArrayRef size, c10::IntArrayRef stride) {
  NEURONMP_OPTRACK("aten::set_.source_Storage_storage_offset");
  return at::native::set_storage_cpu_(self, src, offset, size, stride);
}

// ---------------------------------------------------------------- the fallback

[[noreturn]] void mixed(const c10::Device& a, const c10::Device& b,
                        const c10::OperatorName& op) {
  TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least "
              "two devices, ", a, " and ", b, "! (when checking arguments for ", op, ")");
}

struct Alias {
  at::Tensor cpu, orig;
  bool written;
};

struct Call {
  std::optional<c10::Device> device;
  std::vector<Alias> aliases;

  void note(const at::Tensor& t, const c10::OperatorName& op) {
    if (!t.defined()) return;
    const auto dev = t.device();
    if (dev.type() == kNeuron) {
      if (device && *device != dev) mixed(*device, dev, op);
      device = dev;
    }
  }
  void check_cpu(const at::Tensor& t, const c10::OperatorName& op) {
    // CPU scalars mix with device tensors, as on CUDA
    if (device && t.defined() && t.is_cpu() && t.dim() > 0) mixed(*device, t.device(), op);
  }
  at::Tensor to_cpu(const at::Tensor& t, bool written) {
    if (!t.defined() || t.device().type() != kNeuron) return t;
    auto a = cpu_alias(t);
    aliases.push_back({a, t, written});
    return a;
  }
  // An out= or in-place kernel may have resized its output: the device tensor follows.
  void sync_written() {
    for (auto& a : aliases) {
      if (!a.written) continue;
      auto* ci = a.cpu.unsafeGetTensorImpl();
      auto* oi = a.orig.unsafeGetTensorImpl();
      if (ci->storage().data() != a.orig.storage().data() ||
          ci->storage().nbytes() != a.orig.storage().nbytes())
        oi->set_storage_keep_dtype(adopt_storage(ci->storage(), a.orig.device().index()));
      if (ci->sizes() != oi->sizes() || ci->strides() != oi->strides() ||
          ci->storage_offset() != oi->storage_offset())
        oi->set_sizes_and_strides(ci->sizes(), ci->strides(), ci->storage_offset());
    }
  }
  at::Tensor back(const at::Tensor& out) {
    if (!out.defined() || !out.is_cpu()) return out;
    for (auto& a : aliases)
      if (a.cpu.unsafeGetTensorImpl() == out.unsafeGetTensorImpl()) return a.orig;
    const void* p = out.storage().data();
    for (auto& a : aliases)
      if (p != nullptr && a.orig.storage().data() == p)
        return with_storage(a.orig.storage(), out);  // a view of an input
    return adopt(out, device ? device->index() : current_device());
  }
};

// f(tensor, indices): `indices` for the elements of a Tensor?[] (index, index_put_),
// which may stay on the CPU as on CUDA.
template <typename F>
void each_tensor(c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    v = f(v.toTensor(), false);
  } else if (v.isTensorList()) {
    auto list = v.toTensorList();
    for (size_t i = 0; i < list.size(); ++i) list.set(i, f(list.get(i), false));
  } else if (v.isList()) {
    auto list = v.toList();
    for (size_t i = 0; i < list.size(); ++i) {
      c10::IValue e = list.get(i);
      if (e.isTensor()) list.set(i, f(e.toTensor(), true));
    }
  }
}

// The checks TorchNeuron's device kernels make before the CPU's would, in their words.
void device_kernel_checks(neuronmp_optrack::Slot* slot, const torch::jit::Stack& stack,
                          size_t base) {
  static auto* histc_out = neuronmp_optrack::slot("aten::histc.out");
  if (slot == histc_out) {  // (self, bins, min, max, out)
    const auto& in = stack[base].toTensor();
    const auto& out = stack[base + 4].toTensor();
    TORCH_CHECK(in.scalar_type() == out.scalar_type(),
                "torch.histogram: input tensor and hist tensor should have the same dtype, "
                "but got input ", neuronmp_fidelity::py_name(in.scalar_type()), " and hist ",
                neuronmp_fidelity::py_name(out.scalar_type()));
  }
}

bool returns_view(const c10::FunctionSchema& schema) {
  for (const auto& ret : schema.returns())
    if (ret.alias_info() != nullptr && !ret.alias_info()->isWrite()) return true;
  return false;
}

bool is_generator_arg(const c10::Argument& a) {
  const auto& t = a.real_type();
  return t->kind() == c10::TypeKind::OptionalType &&
         t->castRaw<c10::OptionalType>()->getElementType()->kind() ==
             c10::TypeKind::GeneratorType;
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& name = schema.operator_name();
  auto* slot = neuronmp_optrack::slot_of(op);
  neuronmp_optrack::check_placement(slot, op, *stack);
  const bool index_out = neuronmp_indexing::is_index_out(slot);
  if (!index_out) neuronmp_optrack::hit(slot);
  const size_t n = schema.arguments().size();
  const size_t base = stack->size() - n;
  device_kernel_checks(slot, *stack, base);
  Call call;
  for (size_t i = 0; i < n; ++i) {
    auto& v = (*stack)[base + i];
    each_tensor(v, [&](const at::Tensor& t, bool) { call.note(t, name); return t; });
    if (v.isDevice() && v.toDevice().type() == kNeuron) {
      check_device(v.toDevice().has_index() ? v.toDevice().index() : current_device());
      if (!call.device) call.device = c10::Device(kNeuron, v.toDevice().has_index()
                                                     ? v.toDevice().index()
                                                     : current_device());
    }
  }
  if (call.device) ensure_ready();
  if (index_out && neuronmp_optrack::tls_depth == 0)
    neuronmp_indexing::record(slot, *stack, base, cpu_alias);
  auto fid = neuronmp_fidelity::plan(slot, name, *stack, base, [&](auto&& f) {
    for (size_t i = 0; i < n; ++i)
      each_tensor((*stack)[base + i], [&](const at::Tensor& t, bool) {
        if (t.defined() && t.device().type() == kNeuron) f(t);
        return t;
      });
  });
  // a view's output shares its input's memory: nothing is computed, nothing rounded
  if (fid.round64 && returns_view(schema)) fid.round64 = false;
  for (size_t i = 0; i < n; ++i) {
    auto& v = (*stack)[base + i];
    const auto* alias = schema.arguments()[i].alias_info();
    const bool written = alias != nullptr && alias->isWrite();
    each_tensor(v, [&](const at::Tensor& t, bool indices) {
      if (!indices) call.check_cpu(t, name);
      auto a = call.to_cpu(t, written);
      if (fid.round64 && !written && a.defined() && a.scalar_type() == at::kDouble &&
          t.device().type() == kNeuron)
        return neuronmp_fidelity::rounded_input(a);
      return a;
    });
    if (v.isDevice() && v.toDevice().type() == kNeuron) v = c10::Device(c10::kCPU);
  }
  if (fid.rule == neuronmp_fidelity::kSign && (*stack)[base].isTensor())
    fid.nan_in = (*stack)[base].toTensor().isnan();
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  const size_t r = schema.returns().size();
  if (fid.post()) {
    for (auto& a : call.aliases)
      if (a.written && fid.round64) neuronmp_fidelity::round_to_float32(a.cpu);
    for (size_t i = stack->size() - r; i < stack->size(); ++i)
      each_tensor((*stack)[i], [&](const at::Tensor& t, bool) {
        neuronmp_fidelity::finish(fid, t);
        return t;
      });
  }
  call.sync_written();
  for (size_t i = stack->size() - r; i < stack->size(); ++i)
    each_tensor((*stack)[i], [&](const at::Tensor& t, bool) { return call.back(t); });
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("copy_", copy_);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("resize_", resize_);
  m.impl("set_.source_Tensor", set_tensor);
  m.impl("set_.source_Storage", set_storage);
  m.impl("set_.source_Storage_storage_offset", set_storage_offset);
  m.impl("_has_compatible_shallow_copy_type", compatible_shallow_copy);
  m.impl("record_stream", record_stream);
  m.impl("index.Tensor",
         torch::CppFunction::makeFromBoxedFunction<&neuronmp_indexing::index_kernel<&cpu_alias>>());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// Composite ops that pick their kernel by device type would end in the
// "overrideable" stubs for PrivateUse1: run them as the CPU does instead.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("convolution", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  m.impl("convolution_backward", torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// ---------------------------------------------------------------- autocast

}  // namespace neuronmp_device

// in namespace at: the policy lists name ATen's types unqualified
namespace at {

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

// TorchNeuron's autocast refuses binary_cross_entropy as CUDA's does, with its words
at::Tensor bce_banned(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                      int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to "
              "autocast.\nMany models use a sigmoid layer right before the binary cross entropy "
              "layer.\nIn this case, combine the two layers using "
              "torch.nn.functional.binary_cross_entropy_with_logits\nor "
              "torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits "
              "are\nsafe to autocast.");
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define NMP_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define NMP_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define NMP_FP32_OPT(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define NMP_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(NMP_LOWER)
  AT_FORALL_FP32(NMP_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(NMP_FP32_OPT)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(NMP_PROMOTE)
  m.impl("binary_cross_entropy", TORCH_FN(bce_banned));
}

}  // namespace at

namespace neuronmp_device {

// ---------------------------------------------------------------- fork

void after_fork_in_child() {
  if (g_ready.load()) g_bad_fork = true;
  g_ready = false;
}

// ---------------------------------------------------------------- Python

int clamp_count(int n) {
  TORCH_CHECK(n >= 0, "bad device count ", n);
  return std::min(n, kMaxDevices);  // cores past neuron:127 cannot be named in torch
}

void setup(int count, pybind11::object init) {
  g_count = clamp_count(count);
  if (g_init == nullptr) {
    g_init = new pybind11::object(std::move(init));
    static NeuronHooks hooks;
    at::RegisterPrivateUse1HooksInterface(&hooks);
    pthread_atfork(nullptr, nullptr, &after_fork_in_child);
  } else {
    *g_init = std::move(init);
  }
}

pybind11::dict memory_stats(int device) {
  check_index(device);
  auto& s = g_stats[device];
  pybind11::dict d;
  d["current"] = s.current.load();
  d["peak"] = s.peak.load();
  d["allocated"] = s.allocated.load();
  d["freed"] = s.freed.load();
  d["requests"] = s.requests.load();
  d["frees"] = s.frees.load();
  return d;
}

void reset_peak(int device) {
  check_index(device);
  g_stats[device].peak = g_stats[device].current.load();
}

void reset_accumulated(int device) {
  check_index(device);
  auto& s = g_stats[device];
  s.allocated = 0;
  s.freed = 0;
  s.requests = 0;
  s.frees = 0;
}

// Where a neuron tensor's first element lives, for a peer to map it: (memfd, serial,
// byte offset in the file, bytes mapped), or None for memory no peer can map.
pybind11::object shared_block(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != kNeuron || !t.storage()) return pybind11::none();
  const auto& dp = t.storage().data_ptr();
  if (dp.get_deleter() != &free_block) return pybind11::none();
  const auto* b = static_cast<const Block*>(dp.get_context());
  if (b->fd < 0) return pybind11::none();
  const auto off = static_cast<const char*>(t.const_data_ptr()) -
                   static_cast<const char*>(b->ptr);
  return pybind11::make_tuple(b->fd, b->serial, off, b->mapped);
}

}  // namespace neuronmp_device

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace neuronmp_device;
  m.def("setup", &setup, "device count and the lazy-init callback");
  m.def("mark_ready", [] { g_ready = true; });
  m.def("mark_unready", [] { g_ready = false; });
  m.def("set_count", [](int n) { g_count = clamp_count(n); });
  m.def("check_index", [](int d) { check_index(d); });
  m.def("attach_rank", [](int rank, int world) {
    TORCH_CHECK(world > 0 && world <= kMaxDevices && rank >= 0 && rank < world,
                "bad local rank ", rank, " of ", world);
    g_count = world;
    g_own = rank;
    g_default_device = static_cast<DeviceIndex>(rank);
    tls_device = static_cast<DeviceIndex>(rank);
  });
  m.def("own_index", [] { return g_own.load(); });
  m.def("event_elapsed", &event_elapsed, "TorchNeuron's Event.elapsed_time");
  m.def("current_stream", [](int d) {
    return current_stream(c10::Device(kNeuron, static_cast<DeviceIndex>(d))).id();
  });
  m.def("set_stream", [](int64_t id, int d) {
    check_index(d);
    exchange_stream(c10::Stream(c10::Stream::UNSAFE,
                                c10::Device(kNeuron, static_cast<DeviceIndex>(d)), id));
  });
  m.def("is_ready", [] { return g_ready.load(); });
  m.def("is_in_bad_fork", [] { return g_bad_fork.load(); });
  m.def("device_count", [] { return g_count.load(); });
  m.def("current_device", [] { return static_cast<int>(current_device()); });
  m.def("set_device", [](int d) {
    check_index(d);
    set_current_device(static_cast<DeviceIndex>(d));
  });
  m.def("set_relaxed", [](bool on) { neuronmp_fidelity::g_relaxed = on; },
        "run what Trainium refuses, with the CPU's numerics (NEURONMP_TORCHNEURON_RELAXED)");
  m.def("is_relaxed", [] { return neuronmp_fidelity::g_relaxed.load(); });
  m.def("optrack_configure", &neuronmp_optrack::configure, "TorchNeuron's device kernels");
  m.def("optrack_record", &neuronmp_optrack::record, "record an op as executed or fallen back");
  m.def("optrack_list", &neuronmp_optrack::listed, "the executed (True) or fallen back ops");
  m.def("optrack_clear", &neuronmp_optrack::clear, "forget the ops recorded so far");
  m.def("optrack_enter", &neuronmp_optrack::enter, "a Python device kernel begins");
  m.def("optrack_leave", &neuronmp_optrack::leave, "a Python device kernel ends");
  m.def("memory_stats", &memory_stats);
  m.def("shared_block", &shared_block);
  m.def("shared_min", [] { return kSharedMin; });
  m.def("reset_peak", &reset_peak);
  m.def("reset_accumulated", &reset_accumulated);
  m.def("default_generator", [](int d) {
    return pybind11::reinterpret_steal<pybind11::object>(
        THPGenerator_initDefaultGenerator(generator(static_cast<DeviceIndex>(d))));
  });
}
