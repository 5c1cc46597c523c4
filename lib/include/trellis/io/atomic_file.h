// Whole-file writes that never leave a partial file under the final name, nor a stale temporary behind.
#pragma once
#include <functional>
#include <ostream>
#include <string>

namespace trellis {

// A temporary file "<path>.tmp.<pid>" beside `path` that becomes `path` only through commit(). Until then `path` is
// untouched. A symbolic link is followed: the file it leads to is replaced, the link stays; a file replaced keeps its
// permissions (and its owner, where the process may set it). `path` must be, or become, a regular file. The
// destructor removes the temporary unless it was committed, and so does a SIGINT, SIGTERM or SIGHUP in a program
// that called remove_temporaries_on_signals(). Creating one also removes temporaries of `path` left by processes that
// no longer run (killed by SIGKILL, say). Errors name `path`, never the temporary, with the cause.
class TemporaryFile {
 public:
  // Throws an Error naming `path` as check_writable_location(path, /*regular_only=*/true) does.
  explicit TemporaryFile(std::string path);
  ~TemporaryFile();
  TemporaryFile(const TemporaryFile&) = delete;
  TemporaryFile& operator=(const TemporaryFile&) = delete;

  const std::string& path() const { return path_; }            // the final name
  const std::string& temporary() const { return temporary_; }  // where the content goes
  // The caller has closed the temporary. Flushes it to the disk (fsync), renames it to path() and flushes the
  // directory, so that after a crash the file is either the old one or the whole new one.
  void commit();

 private:
  std::string path_, target_, temporary_;  // the name given, the file it leads to, the temporary beside that
  int slot_ = -1;  // in the registry the signal handler reads
  bool committed_ = false;
};

// Calls write(stream) on a TemporaryFile of `path`, then commits it. On any error (a full disk included, reported
// with its cause) or an exception from write, the temporary is removed and an Error naming `path` is thrown. Where
// `path` is a device or a pipe (/dev/null, a FIFO), the stream writes to it in place, with the same errors.
void write_file_atomically(const std::string& path, const std::function<void(std::ostream&)>& write);

// Throws an Error naming `path` unless a write of it can succeed: for commands that check where their output goes
// before long work. Symbolic links are followed; what is there must be writable by this process and not a directory;
// its directory must exist and be writable unless what is there is a device, pipe or socket (written in place), which
// regular_only refuses (outputs that must be regular files, such as HDF5 files).
void check_writable_location(const std::string& path, bool regular_only = false);

// Installs SIGINT, SIGTERM and SIGHUP handlers that remove every live TemporaryFile and then end the process with the
// signal's default action. For programs (the library itself installs no handler).
void remove_temporaries_on_signals();

}  // namespace trellis
