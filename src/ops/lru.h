// Note [primitive caches]: graft creates a oneDNN primitive per GEMM and convolution shape on first
// use (gemm_dnnl.cpp, conv_dnnl.cpp), and keeps it, since creating one (JIT code generation) costs
// far more than running it. With dynamic shapes (every sequence length a new plan) the shapes never
// stop coming: kept in a plain map they grew the process by tens of KiB per new shape, forever.
// They are kept in an LruCache instead: at most kPrimitiveCacheCapacity, the least recently used
// dropped first (oneDNN's own primitive cache has the same default bound). A caller holds the
// shared_ptr it got while it runs the primitive, so dropping one another thread runs is safe.
#pragma once

#include <cstddef>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace graft::opsutil {

inline constexpr size_t kPrimitiveCacheCapacity = 1024;

template <class K, class V>
class LruCache {
 public:
  explicit LruCache(size_t capacity) : capacity_(capacity) {}

  // The value for `key`; on a miss, make() (a std::shared_ptr<V>, null allowed) is called under the
  // cache's lock and its result kept. An exception from make() leaves the cache as it was.
  template <class Make>
  std::shared_ptr<V> get(const K& key, Make&& make) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = index_.find(key);
    if (it != index_.end()) {
      order_.splice(order_.begin(), order_, it->second);  // most recently used first
      return it->second->second;
    }
    std::shared_ptr<V> v = make();
    order_.emplace_front(key, v);
    index_.emplace(key, order_.begin());
    if (order_.size() > capacity_) {
      index_.erase(order_.back().first);
      order_.pop_back();
    }
    return v;
  }

  size_t size() const {
    std::lock_guard<std::mutex> lk(mu_);
    return order_.size();
  }

 private:
  using Entry = std::pair<K, std::shared_ptr<V>>;
  size_t capacity_;
  mutable std::mutex mu_;
  std::list<Entry> order_;
  std::map<K, typename std::list<Entry>::iterator> index_;
};

}  // namespace graft::opsutil
