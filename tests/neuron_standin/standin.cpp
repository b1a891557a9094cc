// A stand-in for TorchNeuron's native device, for tests only: a PrivateUse1 backend (renamed "neuron" from Python)
// whose memory is host memory and whose kernels are the CPU's. Built with torch.utils.cpp_extension by
// tests/neuron_standin/__init__.py; written against torch's documented PrivateUse1 extension points (allocator,
// device guard, PrivateUse1HooksInterface, a boxed CPU fallback, AutocastPrivateUse1), the same on torch 2.9-2.13.
//
// What runs where: factory ops (empty, empty_strided), copies between devices (_copy_from), storage changes
// (resize_, set_), _local_scalar_dense and the six view ops without a composite kernel are native here; every other
// op reaches the boxed fallback, which runs the CPU kernel on CPU copies of the arguments (at::native::cpu_fallback:
// mutated arguments are copied back, outputs moved to this device) and counts the call.
#include <torch/extension.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace standin {

constexpr auto kDev = c10::DeviceType::PrivateUse1;

c10::DeviceIndex device_count() {
  static const c10::DeviceIndex n = [] {
    const char* env = std::getenv("NXD_LC_STANDIN_DEVICES");
    int v = env ? std::atoi(env) : 1;
    return static_cast<c10::DeviceIndex>(v > 0 ? v : 1);
  }();
  return n;
}

thread_local c10::DeviceIndex g_current = 0;

// ---------------------------------------------------------------------------------------------- counters
std::atomic<int64_t> g_h2d{0}, g_d2h{0}, g_d2d{0}, g_fallbacks{0}, g_fallback_copies{0};
thread_local int g_fallback_depth = 0;  // > 0 inside the CPU fallback: its copies are the fallback's, not the job's
std::mutex g_ops_mutex;
bool g_record_ops = false;
// (op name, dtypes, shapes) -> calls, while recording
std::map<std::tuple<std::string, std::string, std::string>, int64_t> g_ops;

std::string describe_args(const c10::OperatorHandle& op, const torch::jit::Stack& stack, std::string* shapes) {
  const auto n = op.schema().arguments().size();
  std::ostringstream dtypes, dims;
  for (size_t i = stack.size() - n; i < stack.size(); ++i) {
    const auto& iv = stack[i];
    if (iv.isTensor() && iv.toTensor().defined()) {
      const auto& t = iv.toTensor();
      dtypes << c10::toString(t.scalar_type()) << ",";
      dims << t.sizes() << ";";
    } else if (iv.isTensorList()) {
      for (const auto& t : iv.toTensorList().vec()) {
        dtypes << c10::toString(t.scalar_type()) << ",";
        dims << t.sizes() << ";";
      }
    }
  }
  *shapes = dims.str();
  return dtypes.str();
}

// ---------------------------------------------------------------------------------------------- memory
struct DeviceMemory final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = n ? c10::alloc_cpu(n) : nullptr;
    return {p, p, &c10::free_cpu, c10::Device(kDev, g_current)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &c10::free_cpu; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}
  void recordStream(const c10::DataPtr&, c10::Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex) override { return {}; }
  void resetAccumulatedStats(c10::DeviceIndex) override {}
  void resetPeakStats(c10::DeviceIndex) override {}
};
DeviceMemory g_memory;
REGISTER_ALLOCATOR(kDev, &g_memory);

// pinned host memory (pin_memory() of a CPU tensor routes here once PrivateUse1 is the accelerator)
std::mutex g_pinned_mutex;
std::set<const void*> g_pinned;

void free_pinned(void* p) {
  {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    g_pinned.erase(p);
  }
  c10::free_cpu(p);
}

struct PinnedMemory final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = n ? c10::alloc_cpu(n) : nullptr;
    if (p) {
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      g_pinned.insert(p);
    }
    return {p, p, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
PinnedMemory g_pinned_memory;

// ---------------------------------------------------------------------------------------------- device guard
struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kDev; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kDev, g_current); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kDev, "stand-in neuron guard: not a neuron device: ", d);
    if (d.index() >= 0) {
      TORCH_CHECK(d.index() < device_count(), "stand-in neuron: device index ", int(d.index()), " >= ",
                  int(device_count()), " (NXD_LC_STANDIN_DEVICES)");
      g_current = d.index();
    }
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) g_current = d.index();
  }
  c10::Stream getStream(c10::Device d) const noexcept override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getNewStream(c10::Device d, int) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count(); }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    static int marker = 0;
    if (*event == nullptr) *event = &marker;  // synchronous device: an event is complete when recorded
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

// ---------------------------------------------------------------------------------------------- RNG
// A device generator wrapping a CPU generator: the CPU kernels of the fallback take CPU generators only
// (check_generator<CPUGeneratorImpl>), so the fallback hands them the wrapped one.
struct Generator final : c10::GeneratorImpl {
  at::Generator cpu = at::detail::createCPUGenerator();
  explicit Generator(c10::DeviceIndex i)
      : c10::GeneratorImpl(c10::Device(kDev, i), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)) {}
  void set_current_seed(uint64_t seed) override { cpu.set_current_seed(seed); }
  uint64_t current_seed() const override { return cpu.current_seed(); }
  uint64_t seed() override { return cpu.seed(); }
  void set_offset(uint64_t offset) override { cpu.set_offset(offset); }
  uint64_t get_offset() const override { return cpu.get_offset(); }
  void set_state(const c10::TensorImpl& state) override { cpu.unsafeGetGeneratorImpl()->set_state(state); }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    return cpu.unsafeGetGeneratorImpl()->get_state();
  }

 private:
  Generator* clone_impl() const override {
    auto* g = new Generator(device().index());
    g->cpu = cpu.clone();
    return g;
  }
};

const at::Generator& default_generator(c10::DeviceIndex i) {
  static std::vector<at::Generator> gens = [] {
    std::vector<at::Generator> out;
    for (c10::DeviceIndex d = 0; d < device_count(); ++d) out.push_back(at::make_generator<Generator>(d));
    return out;
  }();
  if (i < 0) i = g_current;
  TORCH_CHECK(i < static_cast<c10::DeviceIndex>(gens.size()), "stand-in neuron: no device ", int(i));
  return gens[i];
}

// ---------------------------------------------------------------------------------------------- hooks
struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(c10::DeviceIndex d) const override { g_current = d; }
  c10::DeviceIndex getCurrentDevice() const override { return g_current; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    auto old = g_current;
    g_current = d;
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex i) const override { return default_generator(i); }
  at::Generator getNewGenerator(c10::DeviceIndex i) const override {
    return at::make_generator<Generator>(i < 0 ? g_current : i);
  }
  at::Device getDeviceFromPtr(void*) const override { return at::Device(kDev, g_current); }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    return g_pinned.count(data) > 0;
  }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_memory; }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    at::DataPtr fresh = g_memory.allocate(newsize);
    const size_t keep = std::min(newsize, impl->nbytes());
    if (keep) std::memcpy(fresh.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

int register_hooks() {
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return 0;
}
const int g_hooks_registered = register_hooks();

// ---------------------------------------------------------------------------------------------- native kernels
at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>,
                               std::optional<c10::MemoryFormat> memory_format) {
  return at::detail::empty_generic(size, &g_memory, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>) {
  return at::detail::empty_strided_generic(size, stride, &g_memory,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

// the same host memory seen as a CPU tensor (no copy): the device is host memory
at::Tensor host_alias(const at::Tensor& t) {
  if (t.device().is_cpu()) return t;
  auto storage = t.storage();
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), [storage](void*) {},
                       t.options().device(c10::Device(c10::DeviceType::CPU)));
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  if (g_fallback_depth > 0) {
    ++g_fallback_copies;
  } else if (self.device().is_cpu()) {
    ++g_h2d;
  } else if (dst.device().is_cpu()) {
    ++g_d2h;
  } else {
    ++g_d2d;
  }
  auto dst_host = host_alias(dst);
  dst_host.copy_(host_alias(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

const at::Tensor& resize(const at::Tensor& self, c10::IntArrayRef size,
                         std::optional<c10::MemoryFormat> memory_format) {
  return at::native::resize_(self, size, memory_format);
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                        c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, source, offset, size, stride);
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  const int64_t n = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return at::native::set_storage_cpu_(self, source, 0, {n}, {});
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) { return at::native::set_tensor_(self, source); }

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, &g_memory, true);
  return at::native::set_storage_cpu_(self, storage, 0, {0}, {});
}

c10::Scalar local_scalar_dense(const at::Tensor& self) {
  if (g_fallback_depth == 0) ++g_d2h;
  return at::native::_local_scalar_dense_cpu(host_alias(self));
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) { return at::native::view(self, size); }
at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, offset);
}
at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}
at::Tensor unfold(const at::Tensor& self, int64_t dim, int64_t size, int64_t step) {
  return at::native::unfold(self, dim, size, step);
}
at::Tensor view_as_real(const at::Tensor& self) { return at::native::view_as_real(self); }
at::Tensor view_as_complex(const at::Tensor& self) { return at::native::view_as_complex(self); }

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("resize_", resize);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Tensor", set_tensor);
  m.impl("set_", set_empty);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("view", view);
  m.impl("as_strided", as_strided);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("unfold", unfold);
  m.impl("view_as_real", view_as_real);
  m.impl("view_as_complex", view_as_complex);
}

// ---------------------------------------------------------------------------------------------- CPU fallback
void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  ++g_fallbacks;
  const auto& args = op.schema().arguments();
  const auto base = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {  // device generators -> their CPU generators
    auto& iv = (*stack)[base + i];
    if (iv.isGenerator()) {
      auto g = iv.toGenerator();
      if (g.device().type() == kDev) iv = static_cast<Generator*>(g.unsafeGetGeneratorImpl())->cpu;
    } else if (iv.isNone() && args[i].type()->kind() == c10::TypeKind::OptionalType &&
               args[i].type()->containedType(0)->kind() == c10::TypeKind::GeneratorType) {
      iv = static_cast<Generator*>(default_generator(g_current).unsafeGetGeneratorImpl())->cpu;
    }
  }
  if (g_record_ops) {
    std::string shapes;
    std::string dtypes = describe_args(op, *stack, &shapes);
    std::lock_guard<std::mutex> lock(g_ops_mutex);
    ++g_ops[{c10::toString(op.schema().operator_name()), dtypes, shapes}];
  }
  struct Depth {
    Depth() { ++g_fallback_depth; }
    ~Depth() { --g_fallback_depth; }
  } depth;
  at::native::cpu_fallback(op, stack);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

// ---------------------------------------------------------------------------------------------- autocast
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  KERNEL_PRIVATEUSEONE(mm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(addmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(bmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(baddbmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(matmul, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(linear, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(scaled_dot_product_attention, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(_scaled_dot_product_flash_attention_for_cpu, lower_precision_fp)
}

// ---------------------------------------------------------------------------------------------- Python API
py::dict counters() {
  py::dict d;
  d["host_to_device"] = g_h2d.load();
  d["device_to_host"] = g_d2h.load();
  d["device_to_device"] = g_d2d.load();
  d["fallback_calls"] = g_fallbacks.load();
  d["fallback_copies"] = g_fallback_copies.load();
  return d;
}

void reset_counters() {
  g_h2d = 0;
  g_d2h = 0;
  g_d2d = 0;
  g_fallbacks = 0;
  g_fallback_copies = 0;
}

void record_ops(bool on) {
  std::lock_guard<std::mutex> lock(g_ops_mutex);
  g_record_ops = on;
  if (on) g_ops.clear();
}

py::list recorded_ops() {
  std::lock_guard<std::mutex> lock(g_ops_mutex);
  py::list out;
  for (const auto& [key, calls] : g_ops) {
    out.append(py::make_tuple(std::get<0>(key), std::get<1>(key), std::get<2>(key), calls));
  }
  return out;
}

}  // namespace standin

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("default_generator", [](int64_t i) { return standin::default_generator(static_cast<c10::DeviceIndex>(i)); });
  m.def("device_count", [] { return static_cast<int64_t>(standin::device_count()); });
  m.def("host_alias", &standin::host_alias, "the same host memory as a CPU tensor");
  m.def("counters", &standin::counters);
  m.def("reset_counters", &standin::reset_counters);
  m.def("record_ops", &standin::record_ops);
  m.def("recorded_ops", &standin::recorded_ops);
}
