// A caching CPU allocator: large blocks (>= kMinCachedBytes) freed by a tensor are kept and
// handed to the next allocation of the same rounded size, so a step's intermediates stop
// costing page faults.
//
// Why: glibc returns large blocks to the kernel (munmap) when they are freed, so every fresh
// (tokens, features) intermediate of a prefill is first-touched page by page. On the 2-core
// VM a minor fault costs ~2 us: a 64 x 128-token prefill of SmolLM2 took 1.85 million faults
// (7 GB first-touched), and a 50 MB elementwise op ran 4x slower into a fresh buffer than
// into a reused one. vLLM's CPU workers preload tcmalloc for the same reason; this is the
// smallest allocator that removes the faults, in the spirit of torch's CUDA caching
// allocator: sizes are rounded (to 1 MiB below 64 MiB, to 8 MiB above), each size keeps a
// stack of free blocks, and at most `cache_limit` bytes are kept free; past it a freed block
// goes back to the system. Small allocations go to the allocator that was there before.
//
// Only where the memory comes from changes: no tensor's values, so no output changes.
// (Advising the blocks as transparent huge pages was tried: 64 x 128/128 on SmolLM2 fp32
// went 142-144 -> 134 out tok/s, so blocks stay on normal pages.)

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kMinCachedBytes = size_t{1} << 20;
constexpr size_t kAlignment = 64;

size_t rounded(size_t bytes) {
  const size_t step = bytes < (size_t{64} << 20) ? (size_t{1} << 20) : (size_t{8} << 20);
  return (bytes + step - 1) / step * step;
}

class CachingCpuAllocator final : public c10::Allocator {
 public:
  CachingCpuAllocator(c10::Allocator* fallback, size_t cache_limit)
      : fallback_(fallback), cache_limit_(cache_limit) {}

  c10::DataPtr allocate(size_t bytes) override {
    if (bytes < kMinCachedBytes) return fallback_->allocate(bytes);
    const size_t size = rounded(bytes);
    void* ptr = take(size);
    if (ptr == nullptr) {
      ptr = std::aligned_alloc(kAlignment, size);
      TORCH_CHECK(ptr != nullptr, "heron caching allocator: out of memory allocating ", size,
                  " bytes");
      std::lock_guard<std::mutex> lock(mutex_);
      sizes_[ptr] = size;
    }
    return {ptr, ptr, &release, c10::Device(c10::DeviceType::CPU)};
  }

  // raw_allocate / raw_deallocate (oneDNN's scratch memory goes through them): a block of
  // ours back to the cache, any other to the allocator that made it.
  c10::DeleterFnPtr raw_deleter() const override { return &raw_release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  void set_limit(size_t cache_limit) {
    std::lock_guard<std::mutex> lock(mutex_);
    cache_limit_ = cache_limit;
    trim_locked();
  }

  size_t cached_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return cached_;
  }

  static CachingCpuAllocator* instance;

 private:
  static void release(void* ptr) { instance->give_back(ptr); }

  static void raw_release(void* ptr) {
    if (!instance->owns(ptr)) return instance->fallback_->raw_deleter()(ptr);
    instance->give_back(ptr);
  }

  bool owns(void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    return sizes_.count(ptr) != 0;
  }

  void* take(size_t size) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.find(size);
    if (it == free_.end() || it->second.empty()) return nullptr;
    void* ptr = it->second.back();
    it->second.pop_back();
    cached_ -= size;
    return ptr;
  }

  void give_back(void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t size = sizes_.at(ptr);
    if (cached_ + size > cache_limit_) {
      sizes_.erase(ptr);
      std::free(ptr);
      return;
    }
    free_[size].push_back(ptr);
    cached_ += size;
  }

  void trim_locked() {
    for (auto& [size, blocks] : free_) {
      while (cached_ > cache_limit_ && !blocks.empty()) {
        sizes_.erase(blocks.back());
        std::free(blocks.back());
        blocks.pop_back();
        cached_ -= size;
      }
    }
  }

  c10::Allocator* fallback_;
  size_t cache_limit_;
  size_t cached_ = 0;  // bytes in free_
  std::mutex mutex_;
  std::unordered_map<void*, size_t> sizes_;              // every block this allocator made
  std::unordered_map<size_t, std::vector<void*>> free_;  // rounded size -> free blocks
};

CachingCpuAllocator* CachingCpuAllocator::instance = nullptr;

// From now on CPU tensors of >= 1 MiB come from the cache, which keeps at most
// `cache_limit_mb` MiB of free blocks (a second call only changes the limit). Blocks
// allocated before keep their own deleter.
void use_caching_allocator(int64_t cache_limit_mb) {
  TORCH_CHECK(cache_limit_mb >= 0, "use_caching_allocator: the limit must be >= 0 MiB");
  const size_t limit = static_cast<size_t>(cache_limit_mb) << 20;
  static std::once_flag installed;
  std::call_once(installed, [&] {
    // never deleted: tensors freed at exit still call into it
    CachingCpuAllocator::instance = new CachingCpuAllocator(c10::GetCPUAllocator(), limit);
    c10::SetCPUAllocator(CachingCpuAllocator::instance, /*priority=*/100);
  });
  CachingCpuAllocator::instance->set_limit(limit);
}

// Free bytes the cache holds (0 before use_caching_allocator).
int64_t caching_allocator_cached_bytes() {
  return CachingCpuAllocator::instance == nullptr
             ? 0
             : static_cast<int64_t>(CachingCpuAllocator::instance->cached_bytes());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heron_cpu, m) {
  m.def("use_caching_allocator(int cache_limit_mb) -> ()", &use_caching_allocator);
  m.def("caching_allocator_cached_bytes() -> int", &caching_allocator_cached_bytes);
}
