// token_file: a memory-mapped file of token ids (nanoGPT's flat uint16 or
// uint32 arrays, llm.c's format) as a DataSource of next-token sequences,
// split into training and held-out tokens, each epoch in its own order. Part
// of train/data_source.hpp.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "whale/train/data_source.hpp"

namespace whale {

/// Width of the token ids in a token file.
enum class token_width : std::uint8_t { u16 = 2, u32 = 4 };
/// Which part of a token file a token_file reads.
enum class token_split : std::uint8_t { train, held_out };

struct token_file_options {
  token_width width = token_width::u16;  ///< of a headerless file (llm.c's header says its own)
  double held_out = 0;                   ///< the fraction of tokens at the end kept for evaluation, in [0, 1)
  token_split split = token_split::train;
  index_t vocab = 0;                     ///< > 0: every token read is checked to be below it
  bool shuffle = true;                   ///< windows of each epoch in their own order (from `seed`)
  whale::seed seed{0};
};

/// A memory-mapped file of token ids as a DataSource of next-token sequences:
/// a flat little-endian array of uint16 or uint32 ids (nanoGPT's train.bin), or
/// llm.c's format (a header of 256 int32: 20240520, 1, token count; then
/// uint16 ids). The split's tokens are cut into windows of seq + 1 tokens,
/// overlapping by one (inputs are a window's first seq, labels its last seq);
/// step s takes global windows [s B, s B + B), each epoch in its own order.
class token_file {
 public:
  using input_type = std::int32_t;
  token_file(const std::string& path, index_t seq, index_t global_batch, token_file_options o = {})
      : path_(path), seq_(seq), batch_(global_batch), o_(o) {
    auto fail = [&](const std::string& why) { return std::invalid_argument("whale::token_file '" + path + "': " + why); };
    if (seq < 1) throw fail("seq must be >= 1 (got " + std::to_string(seq) + ")");
    if (global_batch < 1) throw fail("global_batch must be >= 1 (got " + std::to_string(global_batch) + ")");
    if (!(o.held_out >= 0 && o.held_out < 1)) throw fail("held_out must be in [0, 1) (got " + std::to_string(o.held_out) + ")");
    if (o.vocab < 0) throw fail("vocab must be >= 0 (got " + std::to_string(o.vocab) + ")");
    if (o.width != token_width::u16 && o.width != token_width::u32) throw fail("width must be token_width::u16 or u32");
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw fail("cannot open it: " + detail::system_reason(errno));
    struct stat st{};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      throw fail("cannot stat it: " + detail::system_reason(e));
    }
    if (st.st_size <= 0) {
      ::close(fd);
      throw fail("the file is empty");
    }
    bytes_ = static_cast<std::size_t>(st.st_size);
    void* m = ::mmap(nullptr, bytes_, PROT_READ, MAP_SHARED, fd, 0);
    const int e = errno;
    ::close(fd);
    if (m == MAP_FAILED) throw fail("cannot map it: " + detail::system_reason(e));
    map_ = static_cast<const unsigned char*>(m);
    try {
      locate(fail);
    } catch (...) {
      ::munmap(const_cast<unsigned char*>(map_), bytes_);
      throw;
    }
    ::madvise(const_cast<unsigned char*>(map_), bytes_, MADV_RANDOM);
  }
  token_file(const token_file&) = delete;
  token_file& operator=(const token_file&) = delete;
  token_file(token_file&& o) noexcept { *this = std::move(o); }
  token_file& operator=(token_file&& o) noexcept {
    if (this != &o) {
      release();
      path_ = std::move(o.path_);
      seq_ = o.seq_, batch_ = o.batch_, o_ = o.o_;
      map_ = std::exchange(o.map_, nullptr), bytes_ = std::exchange(o.bytes_, 0);
      data_ = o.data_, width_ = o.width_, first_ = o.first_, count_ = o.count_, windows_ = o.windows_;
    }
    return *this;
  }
  ~token_file() { release(); }

  index_t global_batch() const noexcept { return batch_; }
  index_t seq() const noexcept { return seq_; }
  std::int64_t tokens() const noexcept { return count_; }    ///< tokens of this split
  std::int64_t windows() const noexcept { return windows_; }  ///< sequences per epoch

  /// Sequences [begin, begin + count) of step `step`: inputs (count, seq), labels the next tokens.
  batch_view<std::int32_t> get(std::int64_t step, index_t begin, index_t count) {
    detail::check_rows("token_file", begin, count, batch_);
    if (step < 0) throw std::out_of_range("whale::token_file: step " + std::to_string(step) + " is negative");
    x_.resize({count, seq_});
    y_.resize({count * seq_});
    for (index_t r = 0; r < count; ++r) {
      const auto g = static_cast<std::uint64_t>(step) * static_cast<std::uint64_t>(batch_) + static_cast<std::uint64_t>(begin + r);
      const auto w = detail::epoch_order(g, static_cast<std::uint64_t>(windows_), o_.shuffle, o_.seed.value);
      const std::int64_t at = first_ + static_cast<std::int64_t>(w) * seq_;
      for (index_t t = 0; t < seq_; ++t) {
        x_[r * seq_ + t] = token(at + t);
        y_[r * seq_ + t] = token(at + t + 1);
      }
    }
    return {x_.v(), y_.v(), count, seq_};
  }

 private:
  template <class Fail> void locate(Fail& fail) {
    std::int32_t h[3] = {0, 0, 0};
    if (bytes_ >= 1024) std::memcpy(h, map_, sizeof h);
    std::int64_t total = 0;
    if (bytes_ >= 1024 && h[0] == 20240520) {  // llm.c
      if (h[1] != 1) throw fail("llm.c header version " + std::to_string(h[1]) + "; only version 1 (uint16 ids) is read");
      total = h[2];
      if (total < 0 || 1024 + static_cast<std::size_t>(total) * 2 != bytes_)
        throw fail("its llm.c header says " + std::to_string(h[2]) + " tokens but the file has " + std::to_string(bytes_) +
                   " bytes (truncated?)");
      data_ = map_ + 1024;
      width_ = 2;
    } else {
      width_ = static_cast<int>(o_.width);
      if (bytes_ % static_cast<std::size_t>(width_) != 0)
        throw fail(std::to_string(bytes_) + " bytes is not a whole number of " + std::to_string(width_) + "-byte token ids");
      total = static_cast<std::int64_t>(bytes_ / static_cast<std::size_t>(width_));
      data_ = map_;
    }
    const auto held = static_cast<std::int64_t>(std::floor(o_.held_out * static_cast<double>(total)));
    first_ = o_.split == token_split::train ? 0 : total - held;
    count_ = o_.split == token_split::train ? total - held : held;
    windows_ = count_ > seq_ ? (count_ - 1) / seq_ : 0;
    if (windows_ < 1)
      throw fail("its " + std::string(o_.split == token_split::train ? "training" : "held-out") + " part has " +
                 std::to_string(count_) + " tokens, fewer than one sequence of " + std::to_string(seq_) + " + 1" +
                 (o_.split == token_split::held_out && o_.held_out == 0 ? " (set token_file_options::held_out)" : ""));
  }
  std::int32_t token(std::int64_t i) const {
    std::uint32_t v = 0;
    if (width_ == 2) {
      std::uint16_t u;
      std::memcpy(&u, data_ + i * 2, 2);
      v = u;
    } else {
      std::memcpy(&v, data_ + i * 4, 4);
    }
    if ((o_.vocab > 0 && v >= static_cast<std::uint32_t>(o_.vocab)) || v > 0x7fffffffu)
      throw std::out_of_range("whale::token_file '" + path_ + "': token " + std::to_string(v) + " at position " +
                              std::to_string(i) + " is outside the vocabulary of " + std::to_string(o_.vocab));
    return static_cast<std::int32_t>(v);
  }
  void release() noexcept {
    if (map_) ::munmap(const_cast<unsigned char*>(map_), bytes_);
    map_ = nullptr;
  }
  std::string path_;
  index_t seq_ = 0, batch_ = 0;
  token_file_options o_;
  const unsigned char* map_ = nullptr;
  std::size_t bytes_ = 0;
  const unsigned char* data_ = nullptr;
  int width_ = 2;
  std::int64_t first_ = 0, count_ = 0, windows_ = 0;
  tensor<std::int32_t> x_, y_;
};

}  // namespace whale
