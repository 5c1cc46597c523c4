#include "trellis/io/atomic_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <streambuf>

#include "trellis/error.h"

namespace trellis {
namespace {

// Live temporaries, for the signal handler: fixed storage, so that the handler only reads memory that stays valid and
// calls nothing but unlink(), which is async-signal-safe.
constexpr int kSlots = 32;
struct Registry {
  std::array<std::atomic<bool>, kSlots> claimed{};  // owned by a TemporaryFile
  std::array<std::atomic<bool>, kSlots> ready{};    // its path is complete: the handler may read it
  char paths[kSlots][PATH_MAX]{};
};
Registry& registry() {
  static Registry r;
  return r;
}

int register_temporary(const std::string& tmp) {
  if (tmp.size() >= PATH_MAX) return -1;
  Registry& r = registry();
  for (int i = 0; i < kSlots; ++i) {
    bool expected = false;
    if (r.claimed[i].compare_exchange_strong(expected, true)) {
      std::memcpy(r.paths[i], tmp.c_str(), tmp.size() + 1);
      r.ready[i].store(true);
      return i;
    }
  }
  return -1;  // more than kSlots at once: this one is only removed by its destructor
}

void unregister_temporary(int slot) {
  if (slot < 0) return;
  registry().ready[slot].store(false);
  registry().claimed[slot].store(false);
}

void remove_and_reraise(int sig) {
  Registry& r = registry();
  for (int i = 0; i < kSlots; ++i)
    if (r.ready[i].load()) ::unlink(r.paths[i]);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

std::string directory_of(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string cause() { return std::strerror(errno); }

// The file a write of `path` reaches: `path` with its symbolic links followed (a redirection in a shell writes through
// a link, and so does a write here, instead of replacing the link by a file), `path` itself when it is no link.
std::string followed(const std::string& path) {
  std::string at = path;
  for (int hops = 0; hops < 40; ++hops) {
    struct stat st {};
    if (::lstat(at.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return at;
    std::string link(PATH_MAX, '\0');
    const ssize_t n = ::readlink(at.c_str(), link.data(), link.size());
    if (n < 0) throw Error("cannot write '" + path + "': " + cause());
    link.resize(static_cast<std::size_t>(n));
    at = !link.empty() && link.front() == '/' ? link : directory_of(at) + "/" + link;
  }
  throw Error("cannot write '" + path + "': too many levels of symbolic links");
}

// Whether `target` exists and is neither a regular file nor a directory: a device, a pipe or a socket, which a write
// reaches in place (a rename would replace it by a regular file).
bool is_special(const std::string& target) {
  struct stat st {};
  return ::stat(target.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode);
}

// "<name>.tmp.<pid>" of `path` whose process no longer runs.
void remove_stale_temporaries(const std::string& path) {
  const std::string dir = directory_of(path);
  const std::size_t slash = path.rfind('/');
  const std::string prefix = (slash == std::string::npos ? path : path.substr(slash + 1)) + ".tmp.";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0 || name.size() == prefix.size() || name.size() > prefix.size() + 9)
      continue;
    const std::string digits = name.substr(prefix.size());
    if (digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    if (pid != ::getpid() && ::kill(pid, 0) != 0 && errno == ESRCH) ::unlink((dir + "/" + name).c_str());
  }
  ::closedir(d);
}

// An output stream buffer on a file descriptor that keeps the cause (errno) of the first failed write.
class FdBuffer : public std::streambuf {
 public:
  explicit FdBuffer(int fd) : fd_(fd) { setp(buffer_, buffer_ + sizeof buffer_); }
  int error() const { return error_; }
  int sync() override { return drain() ? 0 : -1; }

 protected:
  int_type overflow(int_type c) override {
    if (!drain()) return traits_type::eof();
    if (!traits_type::eq_int_type(c, traits_type::eof())) {
      *pptr() = traits_type::to_char_type(c);
      pbump(1);
    }
    return traits_type::not_eof(c);
  }

 private:
  bool drain() {
    const char* p = pbase();
    while (p < pptr() && error_ == 0) {
      const ssize_t n = ::write(fd_, p, pptr() - p);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) error_ = n < 0 ? errno : EIO;
      else p += n;
    }
    setp(buffer_, buffer_ + sizeof buffer_);
    return error_ == 0;
  }
  int fd_;
  int error_ = 0;
  char buffer_[1 << 16];
};

}  // namespace

void check_writable_location(const std::string& path, bool regular_only) {
  if (path.empty()) throw Error("cannot write '': an empty file name");
  const std::string target = followed(path);
  const std::string dir = directory_of(target);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) throw Error("cannot write '" + path + "': directory '" + dir + "': " + cause());
  if (!S_ISDIR(st.st_mode)) throw Error("cannot write '" + path + "': '" + dir + "' is not a directory");
  if (::stat(target.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) throw Error("cannot write '" + path + "': it is a directory");
    // What is there is replaced only where the user could write it in place (as a shell's redirection could).
    if (::access(target.c_str(), W_OK) != 0) throw Error("cannot write '" + path + "': " + cause());
    if (!S_ISREG(st.st_mode)) {
      if (regular_only)
        throw Error("cannot write '" + path + "': it is not a regular file (a device, pipe or socket), and this " +
                    "output must be one");
      return;  // written in place: the directory is not written
    }
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw Error("cannot write '" + path + "': directory '" + dir + "': " + cause());
}

TemporaryFile::TemporaryFile(std::string path) : path_(std::move(path)) {
  check_writable_location(path_, /*regular_only=*/true);
  target_ = followed(path_);
  temporary_ = target_ + ".tmp." + std::to_string(::getpid());
  remove_stale_temporaries(target_);
  slot_ = register_temporary(temporary_);
}

TemporaryFile::~TemporaryFile() {
  if (!committed_) ::unlink(temporary_.c_str());
  unregister_temporary(slot_);
}

void TemporaryFile::commit() {
  // A file replaced keeps its permissions and, where this process may set them, its owner and group (a user who does
  // not own the file gets the new one as theirs, as with a copy).
  struct stat old {};
  if (::stat(target_.c_str(), &old) == 0 && S_ISREG(old.st_mode)) {
    if (::chmod(temporary_.c_str(), old.st_mode & 07777) != 0) throw Error("cannot write '" + path_ + "': " + cause());
    const int owner_kept = ::chown(temporary_.c_str(), old.st_uid, old.st_gid);
    static_cast<void>(owner_kept);
  }
  const int fd = ::open(temporary_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    const std::string why = cause();
    if (fd >= 0) ::close(fd);
    throw Error("cannot write '" + path_ + "': " + why);
  }
  ::close(fd);
  if (std::rename(temporary_.c_str(), target_.c_str()) != 0) throw Error("cannot write '" + path_ + "': " + cause());
  committed_ = true;
  // The rename itself is durable once the directory is flushed; a failure here leaves a complete file, so it is not
  // reported.
  const int dir = ::open(directory_of(target_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

namespace {

// Calls write(stream) on `fd` and closes it; an error names `path` with the cause of the first failed write or close.
void write_and_close(int fd, const std::string& path, const std::function<void(std::ostream&)>& write) {
  FdBuffer buffer(fd);
  std::ostream out(&buffer);
  try {
    write(out);
  } catch (...) {
    ::close(fd);
    throw;
  }
  out.flush();
  const int write_error = buffer.error();
  const int close_error = ::close(fd) != 0 ? errno : 0;
  if (write_error || close_error || !out)
    throw Error("cannot write '" + path + "': " +
                std::strerror(write_error   ? write_error
                              : close_error ? close_error
                                            : EIO));
}

}  // namespace

void write_file_atomically(const std::string& path, const std::function<void(std::ostream&)>& write) {
  check_writable_location(path);
  const std::string target = followed(path);
  if (is_special(target)) {  // a device or a pipe: written in place
    const int fd = ::open(target.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) throw Error("cannot write '" + path + "': " + cause());
    write_and_close(fd, path, write);
    return;
  }
  TemporaryFile tmp(path);
  const int fd = ::open(tmp.temporary().c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) throw Error("cannot write '" + path + "': " + cause());
  write_and_close(fd, path, write);
  tmp.commit();
}

void remove_temporaries_on_signals() {
  registry();  // constructed before any handler can run
  struct sigaction action {};
  action.sa_handler = remove_and_reraise;
  sigemptyset(&action.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &action, nullptr);
}

}  // namespace trellis
