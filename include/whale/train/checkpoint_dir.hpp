// A checkpoint directory kept safe against crashes and against other jobs
// (train/checkpoint.hpp saves and loads through it):
//   - one job writes there at a time: rank 0 holds an exclusive lock on
//     <dir>/.whale-lock from its first save (or its trainer's start) until the
//     process ends, however it ends; the file names the holder (host, pid, start);
//   - a step is written under a folder of its own job, <step>.partial-<job>, and
//     put in place by one rename; over an older copy of the same step, by an
//     atomic exchange (the older copy is removed only afterwards);
//   - <dir>/latest names the newest complete step, rewritten after it is in place;
//   - loading says so when an interrupted save left a complete folder aside.
// Every point of a save where a crash may happen calls `save_point`, which a
// test can make crash (tests/test_training.cpp).
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/detail/io.hpp"
#include "whale/train/checkpoint_format.hpp"

namespace whale::ckpt {

/// Called with a point's name at each point of a save where a crash may
/// happen (after each file, rename and sync): a test sets it to crash there.
inline std::function<void(const char*)> on_save_point;
/// Whether `publish` may exchange a re-saved step atomically (false: as on a
/// file system without RENAME_EXCHANGE, which a test sets to reach the other way).
inline bool try_exchange = true;
inline void save_point(const char* what) {
  if (on_save_point) on_save_point(what);
}

/// An exclusive, non-waiting lock on `dir`/.whale-lock (flock: the system
/// releases it when the process ends, a crash included). The file holds the
/// holder's host, pid and start time, for the message another job sees.
class folder_lock {
 public:
  folder_lock() = default;
  /// Takes the lock or throws, naming the job that holds it; `who`: the caller, for messages.
  folder_lock(const std::string& dir, const std::string& who) : path_(dir + "/.whale-lock") {
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0)
      throw std::runtime_error(who + ": cannot open the checkpoint directory's lock file '" + path_ + "': " + detail::system_reason(errno));
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      std::string holder;
      char buf[256];
      const auto n = ::pread(fd_, buf, sizeof buf - 1, 0);
      if (n > 0) holder.assign(buf, static_cast<std::size_t>(n));
      while (!holder.empty() && (holder.back() == '\n' || holder.back() == '\0')) holder.pop_back();
      ::close(fd_);
      fd_ = -1;
      if (err != EWOULDBLOCK)
        throw std::runtime_error(who + ": cannot lock the checkpoint directory's lock file '" + path_ + "': " + detail::system_reason(err));
      throw std::runtime_error(who + ": the checkpoint directory '" + dir + "' is in use by another job (" +
                               (holder.empty() ? std::string("it has not yet named itself") : holder) +
                               "): two jobs must not save to one directory; give this job a directory of its own, or wait for that job to end");
    }
    struct stat st {};
    ::fstat(fd_, &st);
    dev_ = st.st_dev, ino_ = st.st_ino;
    const std::string me = holder_text();
    if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
      const int err = errno;
      ::close(fd_);
      fd_ = -1;
      throw std::runtime_error(who + ": cannot write the checkpoint directory's lock file '" + path_ + "': " + detail::system_reason(err));
    }
  }
  folder_lock(folder_lock&& o) noexcept : path_(std::move(o.path_)), fd_(o.fd_), dev_(o.dev_), ino_(o.ino_) { o.fd_ = -1; }
  folder_lock& operator=(folder_lock&& o) noexcept {
    if (this != &o) {
      release();
      path_ = std::move(o.path_), fd_ = o.fd_, dev_ = o.dev_, ino_ = o.ino_;
      o.fd_ = -1;
    }
    return *this;
  }
  ~folder_lock() { release(); }
  /// Whether this lock still guards the lock file at its path (the directory may have been removed and made again).
  bool current() const {
    struct stat st {};
    return fd_ >= 0 && ::stat(path_.c_str(), &st) == 0 && st.st_dev == dev_ && st.st_ino == ino_;
  }
  /// This process as a lock file names it: "host H, pid P, since T UTC".
  static std::string holder_text() {
    char host[256] = "?";
    ::gethostname(host, sizeof host - 1);
    static const std::time_t started = std::time(nullptr);
    char when[64] = "?";
    std::tm tm {};
    if (::gmtime_r(&started, &tm)) std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", &tm);
    return std::string("host ") + host + ", pid " + std::to_string(::getpid()) + ", since " + when + " UTC\n";
  }

 private:
  void release() noexcept {
    if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the flock
    fd_ = -1;
  }
  std::string path_;
  int fd_ = -1;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
};

/// Hold the lock of checkpoint directory `dir` (which exists) for the rest of
/// this process: taken once, kept until exit; throws naming the other job.
inline void hold_folder(const std::string& dir, const std::string& who) {
  static std::mutex mu;
  static std::map<std::string, folder_lock> held;
  const std::string key = std::filesystem::absolute(dir).lexically_normal().string();
  std::lock_guard<std::mutex> g(mu);
  auto it = held.find(key);
  if (it != held.end() && it->second.current()) return;
  folder_lock l(dir, who);
  held.insert_or_assign(key, std::move(l));
}

/// A name for this job's leftovers that no other job uses: its host, pid and start, hashed.
inline std::string job_token() {
  static const std::string token = [] {
    hasher h;
    const std::string me = folder_lock::holder_text();
    const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
    h.add(me.data(), me.size());
    h.add(&now, sizeof now);
    return hex64(h.value()).substr(0, 12);
  }();
  return token;
}

/// Put a complete step folder `part` in place as `final_dir` (in `dir`): a
/// rename, or, over an older copy of the step, an atomic exchange, the older
/// copy removed afterwards; then the directory synced. Never removes first:
/// a crash at any point leaves `final_dir` complete (old or new), or, on a
/// file system without the exchange, the older copy complete beside it.
inline void publish(const std::string& dir, const std::string& part, const std::string& final_dir, const std::string& who) {
  namespace fs = std::filesystem;
  auto fail = [&](const std::string& what, int err) {
    throw std::runtime_error(who + ": cannot " + what + ": " + detail::system_reason(err));
  };
  std::error_code ec;
  if (!fs::exists(final_dir, ec)) {
    if (std::rename(part.c_str(), final_dir.c_str()) != 0) fail("rename '" + part + "' to '" + final_dir + "'", errno);
    save_point("step renamed into place");
    detail::sync_directory(dir, who);
    save_point("directory synced");
    return;
  }
#ifdef RENAME_EXCHANGE
  if (try_exchange && ::renameat2(AT_FDCWD, part.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    save_point("step exchanged with its older copy");
    detail::sync_directory(dir, who);
    save_point("directory synced");
    fs::remove_all(part, ec);  // the older copy, now under the partial name
    save_point("older copy removed");
    return;
  }
  if (try_exchange && errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) fail("exchange '" + part + "' with '" + final_dir + "'", errno);
#endif
  const std::string aside = final_dir + ".old-" + job_token();  // no exchange here: move the older copy aside first
  if (std::rename(final_dir.c_str(), aside.c_str()) != 0) fail("rename '" + final_dir + "' to '" + aside + "'", errno);
  save_point("older copy moved aside");
  if (std::rename(part.c_str(), final_dir.c_str()) != 0) fail("rename '" + part + "' to '" + final_dir + "'", errno);
  save_point("step renamed into place");
  detail::sync_directory(dir, who);
  save_point("directory synced");
  fs::remove_all(aside, ec);
  save_point("older copy removed");
}

/// Point `dir`/latest at step folder `name` (written atomically, after the step is in place).
inline void set_latest(const std::string& dir, const std::string& name, const std::string& who) {
  detail::write_file_atomically(dir + "/latest", name + "\n", who);
  save_point("latest written");
}

/// The step `dir`/latest names ("step-<N>"), or "" without a valid one.
inline std::string pointed(const std::string& dir) {
  std::ifstream f(dir + "/latest");
  std::string name;
  if (!f || !std::getline(f, name) || !is_step_name(name)) return {};
  return name;
}

/// Folders an interrupted save left in `dir` that hold a complete checkpoint
/// (a step's partial or set-aside folder with its meta.txt), sorted by name;
/// `step`: only that step's ("step-<N>").
inline std::vector<std::string> leftovers(const std::string& dir, const std::string& step = {});

/// The newest complete checkpoint in `dir`: the step `latest` names; if that
/// folder is missing (a re-save without an atomic exchange was interrupted
/// between its two renames), that step's complete partial folder, else its
/// set-aside older copy; without `latest` (a directory from before it
/// existed), the highest step with its meta.txt; "" if none.
inline std::string latest(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (const auto name = pointed(dir); !name.empty()) {
    if (fs::exists(dir + "/" + name + "/meta.txt", ec)) return dir + "/" + name;
    const auto left = leftovers(dir, name);
    for (const auto& l : left)
      if (l.find(".partial-", dir.size()) != std::string::npos) return l;  // complete before the older copy moved aside
    if (!left.empty()) return left.front();
  }
  std::string best;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (is_step_name(n) && fs::exists(e.path() / "meta.txt") && n > best) best = n;
  }
  return best.empty() ? best : dir + "/" + best;
}

inline std::vector<std::string> leftovers(const std::string& dir, const std::string& step) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.size() > 14 && is_step_name(n.substr(0, 13)) && (step.empty() || n.compare(0, 13, step) == 0) &&
        (n.rfind(".partial-", 13) == 13 || n.rfind(".old-", 13) == 13) &&
        std::filesystem::exists(e.path() / "meta.txt"))
      out.push_back(dir + "/" + n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

/// What to tell a user about `leftovers` of `dir` (empty if none): which complete
/// folders were not put in place, and how to use one.
inline std::string leftover_note(const std::vector<std::string>& left) {
  if (left.empty()) return {};
  std::string s = "an interrupted save left " + std::to_string(left.size()) + " complete folder" + (left.size() > 1 ? "s" : "") + " aside (";
  for (std::size_t i = 0; i < left.size(); ++i) s += (i ? ", '" : "'") + left[i] + "'";
  const auto name = std::filesystem::path(left.back()).filename().string().substr(0, 13);
  return s + "); to use one, rename it to its step's name (e.g. '" + name + "') and write that name into the directory's 'latest' file";
}

}  // namespace whale::ckpt
