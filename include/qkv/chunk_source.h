// A chunk source: the rows of an attention database, keys (N, D) and values
// (N, Dv), read a chunk of rows at a time. Attention over a store
// (qkv/store_attention.h), its MPI sharding (qkv/mpi.h) and the search
// engine read rows only through this interface, so a storage backend is one
// class that implements it: the on-disk KeyValueStore (qkv/store.h) is one.
//
// A backend promises: chunks cover rows [0, rows()) in order without gaps
// (chunk c's first row is chunk c-1's first row plus its rows); chunk_range
// answers without reading; read_chunk returns views of rows x D keys and
// rows x Dv values of the source's dtype that stay valid while the returned
// chunk's keep-alive lives; every member may be called from several threads
// at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "qkv/bfloat16.h"
#include "qkv/error.h"
#include "qkv/tensor.h"

namespace qkv {

// The element type of a source's keys and values.
enum class StoreDtype { kFloat32, kBFloat16 };
// "float32", "bfloat16"
std::string_view store_dtype_name(StoreDtype dtype);

// Called as work proceeds with the bytes done and the bytes in all, for
// progress reports; may be empty.
using StoreProgress = std::function<void(int64_t done, int64_t total)>;

// Rows [first_row, first_row + rows) of a source.
struct ChunkRange {
  int64_t first_row = 0;
  int64_t rows = 0;
};

// One chunk's keys (rows, D) and values (rows, Dv), as views of the source's
// dtype; they stay valid while this object (or a copy) lives.
class SourceChunk {
 public:
  // `check`, if given, is check_intact(): it throws if the rows may have
  // changed while they were read.
  SourceChunk(ChunkRange range, ConstView<float> keys, ConstView<float> values,
              std::shared_ptr<const void> keep_alive, std::function<void()> check = {})
      : range_(range),
        dtype_(StoreDtype::kFloat32),
        keys_f32_(keys),
        values_f32_(values),
        keep_alive_(std::move(keep_alive)),
        check_(std::move(check)) {}
  SourceChunk(ChunkRange range, ConstView<bfloat16> keys, ConstView<bfloat16> values,
              std::shared_ptr<const void> keep_alive, std::function<void()> check = {})
      : range_(range),
        dtype_(StoreDtype::kBFloat16),
        keys_bf16_(keys),
        values_bf16_(values),
        keep_alive_(std::move(keep_alive)),
        check_(std::move(check)) {}

  const ChunkRange& range() const { return range_; }
  StoreDtype dtype() const { return dtype_; }
  // The same rows numbered from `first_row`: for a source over part of
  // another's chunks.
  SourceChunk renumbered(int64_t first_row) const {
    SourceChunk chunk = *this;
    chunk.range_.first_row = first_row;
    return chunk;
  }
  // Call after the views were used, before trusting what was computed from
  // them: Error (naming what changed) if the backend finds the rows may
  // have changed while they were read, e.g. a store's chunk file truncated
  // meanwhile (qkv/store.h's MappedFile); nothing for a backend without
  // such a check.
  void check_intact() const {
    if (check_) check_();
  }
  // The keys and values as T, which must be the chunk's dtype's type (float
  // for kFloat32, bfloat16 for kBFloat16); Error otherwise.
  template <class T>
  ConstView<T> keys() const {
    return pick<T>(keys_f32_, keys_bf16_, "keys");
  }
  template <class T>
  ConstView<T> values() const {
    return pick<T>(values_f32_, values_bf16_, "values");
  }

 private:
  template <class T>
  ConstView<T> pick(const ConstView<float>& f32, const ConstView<bfloat16>& bf16,
                    const char* what) const {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, bfloat16>,
                  "a chunk holds float or bfloat16");
    constexpr StoreDtype want =
        std::is_same_v<T, float> ? StoreDtype::kFloat32 : StoreDtype::kBFloat16;
    if (dtype_ != want) {
      fail("SourceChunk::" + std::string(what), "the chunk holds " +
                                                    std::string(store_dtype_name(dtype_)) +
                                                    ", not " + std::string(store_dtype_name(want)));
    }
    if constexpr (std::is_same_v<T, float>) {
      return f32;
    } else {
      return bf16;
    }
  }

  ChunkRange range_;
  StoreDtype dtype_;
  ConstView<float> keys_f32_, values_f32_;
  ConstView<bfloat16> keys_bf16_, values_bf16_;
  std::shared_ptr<const void> keep_alive_;
  std::function<void()> check_;
};

class ChunkSource {
 public:
  virtual ~ChunkSource() = default;

  // How messages name this source, e.g. "store /data/memory.qkv".
  virtual std::string name() const = 0;
  virtual StoreDtype dtype() const = 0;
  virtual int64_t rows() const = 0;
  virtual int64_t key_dim() const = 0;
  virtual int64_t value_dim() const = 0;
  virtual size_t num_chunks() const = 0;
  // Chunk `index`'s rows, without reading them; index < num_chunks().
  virtual ChunkRange chunk_range(size_t index) const = 0;
  // Chunk `index`'s keys and values; Error (IoError when the system fails)
  // naming what could not be read.
  virtual SourceChunk read_chunk(size_t index) const = 0;
  // A hint that chunk `index` is read next: a backend may start reading it
  // now, so a cold read overlaps the work on the chunk before it.
  virtual void read_ahead(size_t /*index*/) const {}

 protected:
  ChunkSource() = default;
  ChunkSource(const ChunkSource&) = default;
  ChunkSource& operator=(const ChunkSource&) = default;
  ChunkSource(ChunkSource&&) = default;
  ChunkSource& operator=(ChunkSource&&) = default;
};

}  // namespace qkv
