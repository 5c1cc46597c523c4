#include "trellis/hmm/hmm_io.h"

#include <H5Cpp.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <future>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "trellis/io/atomic_file.h"
#include "lib/src/io/message.h"
#include "trellis/error.h"

// The writers' file driver below fills HDF5's driver table by field name, as laid out by HDF5 1.10 and 1.12 (1.14
// moved it to H5FDdevelop.h and added fields).
static_assert(H5_VERS_MAJOR == 1 && H5_VERS_MINOR >= 10 && H5_VERS_MINOR <= 12,
              "hmm_io.cpp's file driver is written for HDF5 1.10/1.12");

namespace trellis {
namespace {

constexpr int64_t kModelVersion = 1;

// What went wrong in the HDF5 call that failed last on this thread: the operating system's reason where a file
// operation failed ("No such file or directory"), else the innermost message on HDF5's error stack.
std::string hdf5_cause() {
  struct Found {
    std::string system, innermost;
  } found;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_DOWNWARD,
      [](unsigned, const H5E_error2_t* e, void* data) -> herr_t {
        auto& f = *static_cast<Found*>(data);
        const std::string desc = e->desc ? e->desc : "";
        const std::size_t at = desc.find("error message = '");
        if (at != std::string::npos && f.system.empty()) {
          const std::size_t begin = at + std::strlen("error message = '");
          f.system = desc.substr(begin, desc.find('\'', begin) - begin);
        }
        if (!desc.empty()) f.innermost = desc;
        return 0;
      },
      &found);
  return found.system.empty() ? found.innermost : found.system;
}

// The Error for HDF5's exception e on the file `path`, given hdf5_cause() (taken first: any further HDF5 call clears
// the error stack).
Error hdf5_error(const std::string& path, const H5::Exception& e, const std::string& cause) {
  return Error(path + ": HDF5 error in " + e.getFuncName() + ": " + (cause.empty() ? e.getDetailMsg() : cause));
}

// Runs f, turning HDF5's exceptions (which are not std::exceptions) into Errors that name the file.
template <class F>
auto h5(const std::string& path, F&& f) {
  H5::Exception::dontPrint();
  try {
    return f();
  } catch (const H5::Exception& e) {
    throw hdf5_error(path, e, hdf5_cause());
  }
}

// Called inside h5(): a missing, unreadable or non-HDF5 file (or a directory) gets a plain message instead of an
// HDF5 error stack.
H5::H5File open_readonly(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || ::access(path.c_str(), R_OK) != 0)
    throw Error("cannot open '" + path + "': " + std::strerror(errno));
  if (S_ISDIR(st.st_mode)) throw Error("cannot open '" + path + "': it is a directory, not an HDF5 file");
  if (H5::H5File::isHdf5(path.c_str()) <= 0) throw Error(path + ": not an HDF5 file");
  try {
    return H5::H5File(path, H5F_ACC_RDONLY);
  } catch (const H5::Exception& e) {
    // HDF5 reports a file cut short (an interrupted copy or download) as "truncated file: eof = ..., stored_eof = ...".
    const std::string cause = hdf5_cause();
    if (cause.find("truncated file") == std::string::npos) throw hdf5_error(path, e, cause);
    throw Error(path + ": the HDF5 file is truncated: it holds " + std::to_string(st.st_size) +
                " bytes, fewer than its header records (an interrupted copy or write?)");
  }
}

// ---- the writers' file driver ----

// HDF5 caches what it writes and reports a failed write (a full disk) from whichever call flushes it, a dataset's or
// the file's close included, and HDF5 1.10 crashes when a file whose close failed is closed again (as every open file
// is at exit). The writers therefore write through this POSIX driver, which never fails a write: it keeps the first
// error (its errno) in a WriteError and drops every later write, so that the file always closes cleanly; the writer
// then reports the error and never renames the file.
struct WriteError {
  int error = 0;  // errno of the first failed write, truncation or close
  void keep(int e) {
    if (error == 0) error = e ? e : EIO;
  }
};

struct DriverFile {
  H5FD_t base;  // first, as HDF5 hands the driver H5FD_t pointers to its own files
  int fd;
  haddr_t eoa, eof;
  dev_t device;
  ino_t inode;
  WriteError* failure;
};
DriverFile* driver_file(H5FD_t* f) { return reinterpret_cast<DriverFile*>(f); }
const DriverFile* driver_file(const H5FD_t* f) { return reinterpret_cast<const DriverFile*>(f); }

void push_driver_error(const char* function, H5E_minor_t minor, const std::string& what, int error) {
  // The sec2 driver's wording, so that hdf5_cause() finds the reason the same way.
  H5Epush2(H5E_DEFAULT, __FILE__, function, __LINE__, H5E_ERR_CLS, H5E_VFL, minor,
           "%s, errno = %d, error message = '%s'", what.c_str(), error, std::strerror(error));
}

H5FD_t* driver_open(const char* name, unsigned flags, hid_t fapl, haddr_t) {
  WriteError* const* failure = static_cast<WriteError* const*>(H5Pget_driver_info(fapl));
  int mode = O_CLOEXEC | ((flags & H5F_ACC_RDWR) ? O_RDWR : O_RDONLY);
  if (flags & H5F_ACC_TRUNC) mode |= O_TRUNC;
  if (flags & H5F_ACC_CREAT) mode |= O_CREAT;
  if (flags & H5F_ACC_EXCL) mode |= O_EXCL;
  const int fd = ::open(name, mode, 0666);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) {
    const int error = errno;
    if (fd >= 0) ::close(fd);
    push_driver_error("driver_open", H5E_CANTOPENFILE, std::string("unable to open file: name = '") + name + "'",
                      error);
    return nullptr;
  }
  auto* f = new DriverFile{};
  f->fd = fd;
  f->eof = st.st_size;
  f->device = st.st_dev;
  f->inode = st.st_ino;
  f->failure = failure ? *failure : nullptr;
  return &f->base;
}

herr_t driver_close(H5FD_t* file) {
  DriverFile* f = driver_file(file);
  if (::close(f->fd) != 0 && f->failure) f->failure->keep(errno);
  delete f;
  return 0;
}

int driver_compare(const H5FD_t* a, const H5FD_t* b) {
  const DriverFile *x = driver_file(a), *y = driver_file(b);
  if (x->device != y->device) return x->device < y->device ? -1 : 1;
  if (x->inode != y->inode) return x->inode < y->inode ? -1 : 1;
  return 0;
}

herr_t driver_query(const H5FD_t*, unsigned long* flags) {
  // The sec2 driver's caching features.
  *flags = H5FD_FEAT_AGGREGATE_METADATA | H5FD_FEAT_ACCUMULATE_METADATA | H5FD_FEAT_DATA_SIEVE |
           H5FD_FEAT_AGGREGATE_SMALLDATA;
  return 0;
}

haddr_t driver_get_eoa(const H5FD_t* f, H5FD_mem_t) { return driver_file(f)->eoa; }
herr_t driver_set_eoa(H5FD_t* f, H5FD_mem_t, haddr_t addr) {
  driver_file(f)->eoa = addr;
  return 0;
}
haddr_t driver_get_eof(const H5FD_t* f, H5FD_mem_t) { return driver_file(f)->eof; }
herr_t driver_get_handle(H5FD_t* f, hid_t, void** handle) {
  *handle = &driver_file(f)->fd;
  return 0;
}

herr_t driver_read(H5FD_t* file, H5FD_mem_t, hid_t, haddr_t addr, size_t size, void* buffer) {
  const DriverFile* f = driver_file(file);
  char* out = static_cast<char*>(buffer);
  while (size > 0) {
    const ssize_t n = ::pread(f->fd, out, size, static_cast<off_t>(addr));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      push_driver_error("driver_read", H5E_READERROR, "file read failed", errno);
      return -1;
    }
    if (n == 0) {  // past the end of the file (or of what reached it): zeros, as the sec2 driver reads
      std::memset(out, 0, size);
      break;
    }
    out += n;
    addr += n;
    size -= n;
  }
  return 0;
}

herr_t driver_write(H5FD_t* file, H5FD_mem_t, hid_t, haddr_t addr, size_t size, const void* buffer) {
  DriverFile* f = driver_file(file);
  f->eof = std::max(f->eof, addr + size);
  const char* in = static_cast<const char*>(buffer);
  while (size > 0 && f->failure->error == 0) {
    const ssize_t n = ::pwrite(f->fd, in, size, static_cast<off_t>(addr));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      f->failure->keep(n < 0 ? errno : EIO);
      break;
    }
    in += n;
    addr += n;
    size -= n;
  }
  return 0;
}

herr_t driver_truncate(H5FD_t* file, hid_t, hbool_t) {
  DriverFile* f = driver_file(file);
  if (f->eoa != f->eof && f->failure->error == 0 && ::ftruncate(f->fd, static_cast<off_t>(f->eoa)) != 0)
    f->failure->keep(errno);
  f->eof = f->eoa;
  return 0;
}

hid_t write_driver() {
  static const hid_t id = [] {
    static H5FD_class_t c{};
    c.name = "trellis_writer";
    c.maxaddr = static_cast<haddr_t>(std::numeric_limits<off_t>::max());
    c.fc_degree = H5F_CLOSE_STRONG;
    c.fapl_size = sizeof(WriteError*);
    c.open = driver_open;
    c.close = driver_close;
    c.cmp = driver_compare;
    c.query = driver_query;
    c.get_eoa = driver_get_eoa;
    c.set_eoa = driver_set_eoa;
    c.get_eof = driver_get_eof;
    c.get_handle = driver_get_handle;
    c.read = driver_read;
    c.write = driver_write;
    c.truncate = driver_truncate;
    const H5FD_mem_t map[H5FD_MEM_NTYPES] = H5FD_FLMAP_DICHOTOMY;
    std::copy(map, map + H5FD_MEM_NTYPES, c.fl_map);
    return H5FDregister(&c);
  }();
  if (id < 0) throw Error("HDF5: cannot register the writers' file driver: " + hdf5_cause());
  return id;
}

// An HDF5 file written under a TemporaryFile: a temporary name beside the final one, removed unless commit()
// renames it. commit() closes the file (and with it every object still open in it), and renames it only when HDF5
// and every write of the file driver succeeded.
class H5Output {
 public:
  explicit H5Output(const std::string& path) : tmp_(path) {
    H5::Exception::dontPrint();
    const hid_t access = H5Pcreate(H5P_FILE_ACCESS);
    WriteError* failure = &failure_;
    if (access < 0 || H5Pset_driver(access, write_driver(), &failure) < 0 ||
        H5Pset_fclose_degree(access, H5F_CLOSE_STRONG) < 0 ||
        (file_ = H5Fcreate(tmp_.temporary().c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, access)) < 0) {
      const std::string cause = hdf5_cause();
      if (access >= 0) H5Pclose(access);
      throw Error("cannot write '" + path + "': " + cause);
    }
    H5Pclose(access);
    const hid_t root = H5Gopen2(file_, "/", H5P_DEFAULT);
    if (root < 0) {
      const std::string cause = hdf5_cause();
      H5Fclose(std::exchange(file_, H5I_INVALID_HID));
      fail(cause);
    }
    root_ = H5::Group(root);  // takes a reference of its own
    H5Gclose(root);
  }
  ~H5Output() {
    if (file_ < 0) return;
    try {
      root_.close();
    } catch (const H5::Exception&) {
    }
    H5Fclose(file_);  // the temporary is removed whatever happens here
  }
  H5Output(const H5Output&) = delete;
  H5Output& operator=(const H5Output&) = delete;

  const std::string& path() const { return tmp_.path(); }
  H5::Group& root() { return root_; }

  // Runs f (which writes), turning a failure into an Error naming the final path and the cause.
  template <class F>
  auto write(F&& f) {
    H5::Exception::dontPrint();
    try {
      auto result = f();
      check();
      return result;
    } catch (const H5::Exception& e) {
      const std::string cause = hdf5_cause();
      fail(cause.empty() ? e.getDetailMsg() : cause);
    }
  }
  void write_void(const std::function<void()>& f) {
    write([&] {
      f();
      return 0;
    });
  }
  // Throws if a write has failed so far (a full disk), so that long work stops at the first failure.
  void check() const {
    if (failure_.error) fail(std::strerror(failure_.error));
  }

  // Starts the disk writes of what the file holds so far without waiting for them, so that the flush in commit() has
  // less left to do. A failure shows there.
  void start_writeback() const {
    void* handle = nullptr;
    if (H5Fget_vfd_handle(file_, H5P_DEFAULT, &handle) >= 0 && handle)
      ::sync_file_range(*static_cast<const int*>(handle), 0, 0, SYNC_FILE_RANGE_WRITE);
  }

  void commit() {
    write_void([&] { root_.close(); });
    if (H5Fclose(std::exchange(file_, H5I_INVALID_HID)) < 0) fail(hdf5_cause());
    check();
    tmp_.commit();
  }

 private:
  [[noreturn]] void fail(const std::string& cause) const {
    throw Error("cannot write '" + path() + "': " + (failure_.error ? std::strerror(failure_.error) : cause));
  }

  TemporaryFile tmp_;
  WriteError failure_;
  hid_t file_ = H5I_INVALID_HID;
  H5::Group root_;
};

const H5::PredType& native_type(at::ScalarType t) {
  switch (t) {
    case at::kInt: return H5::PredType::NATIVE_INT32;
    case at::kLong: return H5::PredType::NATIVE_INT64;
    case at::kFloat: return H5::PredType::NATIVE_FLOAT;
    case at::kDouble: return H5::PredType::NATIVE_DOUBLE;
    default: throw Error("HDF5: no native type for " + std::string(c10::toString(t)));
  }
}

void write_int64s(H5::Group& file, const std::string& name, const std::vector<int64_t>& values) {
  const hsize_t n = values.size();
  file.createDataSet(name, H5::PredType::STD_I64LE, H5::DataSpace(1, &n))
      .write(values.data(), H5::PredType::NATIVE_INT64);
}

bool exists(const H5::Group& file, const std::string& name) {
  return H5Lexists(file.getId(), name.c_str(), H5P_DEFAULT) > 0;
}

// The dataset `name`, which must be one (not a group).
H5::DataSet open_dataset(const H5::Group& file, const std::string& path, const std::string& name) {
  if (!exists(file, name)) throw Error(path + ": missing dataset '/" + name + "'");
  if (file.childObjType(name) != H5O_TYPE_DATASET) throw Error(path + ": '/" + name + "' is not a dataset (a group?)");
  return file.openDataSet(name);
}

std::vector<hsize_t> dims_of(const H5::DataSet& ds) {
  const H5::DataSpace sp = ds.getSpace();
  std::vector<hsize_t> d(sp.getSimpleExtentNdims());
  sp.getSimpleExtentDims(d.data());
  return d;
}

// A dataset's dimensions are whatever the file says (a chunked dataset of a billion rows may take no space on the
// disk): an error, not an allocation failure, when reading it whole would not fit in memory.
void check_readable(const std::string& path, const std::string& name, const std::vector<hsize_t>& dims,
                    double element_bytes) {
  double n = 1;
  for (hsize_t d : dims) n *= static_cast<double>(d);
  check_fits_in_memory(n * element_bytes, path + ": dataset '/" + name + "'");
}

std::vector<std::string> read_strings(const H5::Group& file, const std::string& path, const std::string& name) {
  if (!exists(file, name)) return {};
  const H5::DataSet ds = open_dataset(file, path, name);
  const auto d = dims_of(ds);
  if (ds.getTypeClass() != H5T_STRING || d.size() != 1)
    throw Error(path + ": dataset '" + name + "' must be a 1-d array of strings");
  const H5::StrType type = ds.getStrType();
  check_readable(path, name, d,
                 static_cast<double>(sizeof(std::string) + (type.isVariableStr() ? sizeof(char*) : type.getSize())));
  std::vector<std::string> out(d[0]);
  if (type.isVariableStr()) {
    std::vector<char*> raw(d[0]);
    H5::StrType mem(H5::PredType::C_S1, H5T_VARIABLE);
    mem.setCset(type.getCset());  // HDF5 does not convert between ASCII and UTF-8 sets
    ds.read(raw.data(), mem);
    for (std::size_t i = 0; i < raw.size(); ++i) out[i] = raw[i] ? raw[i] : "";
    H5Dvlen_reclaim(mem.getId(), ds.getSpace().getId(), H5P_DEFAULT, raw.data());
  } else {
    const std::size_t n = type.getSize();
    std::vector<char> raw(n * d[0]);
    ds.read(raw.data(), type);
    for (std::size_t i = 0; i < d[0]; ++i) out[i] = std::string(&raw[i * n], strnlen(&raw[i * n], n));
  }
  return out;
}

void write_strings(H5::Group& file, const std::string& name, const std::vector<std::string>& values) {
  if (values.empty()) return;
  H5::StrType type(H5::PredType::C_S1, H5T_VARIABLE);
  type.setCset(H5T_CSET_UTF8);
  std::vector<const char*> raw;
  for (const auto& v : values) raw.push_back(v.c_str());
  const hsize_t n = values.size();
  file.createDataSet(name, type, H5::DataSpace(1, &n)).write(raw.data(), type);
}

std::string read_string_attribute(const H5::Group& root, const std::string& path, const std::string& name) {
  if (!root.attrExists(name)) throw Error(path + ": not a Trellis HMM model (no '" + name + "' attribute)");
  const H5::Attribute a = root.openAttribute(name);
  if (a.getTypeClass() != H5T_STRING) throw Error(path + ": attribute '" + name + "' must be a string");
  // One string: HDF5 reads an empty (null) or longer attribute into the one std::string regardless.
  const H5::DataSpace space = a.getSpace();
  if (space.getSimpleExtentType() == H5S_NULL || space.getSimpleExtentNpoints() != 1)
    throw Error(path + ": attribute '" + name + "' must hold exactly one string");
  std::string s;
  a.read(a.getStrType(), s);
  return s;
}

void write_attribute(H5::Group& root, const std::string& name, const std::string& value) {
  H5::StrType type(H5::PredType::C_S1, H5T_VARIABLE);
  type.setCset(H5T_CSET_UTF8);
  const char* raw = value.c_str();
  root.createAttribute(name, type, H5::DataSpace(H5S_SCALAR)).write(type, &raw);
}

// A chunked dataset whose chunks were never written (or a contiguous one never written) reads as its fill value: 16 GB
// of them fit in a file of a few kilobytes. Compressed numbers shrink far less than ten-thousandfold (deflate at most
// about a thousandfold), so a dataset of over 256 MB stored in less than a ten-thousandth of that is damaged.
// element_bytes: the size of one number as it will be held in memory.
void check_stored(const std::string& path, const std::string& name, const H5::DataSet& ds, double element_bytes) {
  double logical = element_bytes;
  for (hsize_t n : dims_of(ds)) logical *= static_cast<double>(n);
  const double stored = static_cast<double>(ds.getStorageSize());
  if (logical > 256.0 * (1 << 20) && stored * 1e4 < logical) {
    char sizes[96];
    std::snprintf(sizes, sizeof sizes, "%.3g GB of numbers but the file stores only %.0f bytes", logical / 1e9, stored);
    throw Error(path + ": dataset '" + name + "' claims " + sizes + " of them (a damaged file)");
  }
}

// A float64 dataset of exactly `shape` (read whole, small).
at::Tensor read_doubles(const H5::Group& file, const std::string& path, const std::string& name,
                        std::vector<int64_t> shape) {
  const H5::DataSet ds = open_dataset(file, path, name);
  const auto d = dims_of(ds);
  const std::vector<int64_t> got(d.begin(), d.end());
  if (ds.getTypeClass() != H5T_FLOAT && ds.getTypeClass() != H5T_INTEGER)
    throw Error(path + ": dataset '" + name + "' must hold numbers");
  bool fits = got.size() == shape.size();
  for (std::size_t i = 0; fits && i < shape.size(); ++i) fits = shape[i] < 0 || got[i] == shape[i];
  if (!fits)
    throw Error(path + ": dataset '" + name + "' has shape " + message::text(at::IntArrayRef(got)) + ", expected " +
                message::text(at::IntArrayRef(shape)) + " (-1: any size)");
  check_readable(path, name, d, sizeof(double));
  check_stored(path, name, ds, sizeof(double));
  at::Tensor t = at::empty(got, at::kDouble);
  ds.read(t.data_ptr<double>(), H5::PredType::NATIVE_DOUBLE);
  return t;
}

// "name[i][j]" of the first true entry of `bad` (a [R] or [R,C] mask).
std::string first_index(const std::string& name, const at::Tensor& bad) {
  std::string s = name;
  const at::Tensor i = bad.nonzero()[0];
  for (int64_t d = 0; d < i.size(0); ++d) s += "[" + std::to_string(i[d].item<int64_t>()) + "]";
  return s;
}

void write_doubles(H5::Group& file, const std::string& name, const at::Tensor& t) {
  const at::Tensor c = t.detach().cpu().to(at::kDouble).contiguous();
  std::vector<hsize_t> d(c.sizes().begin(), c.sizes().end());
  file.createDataSet(name, H5::PredType::IEEE_F64LE, H5::DataSpace(d.size(), d.data()))
      .write(c.data_ptr<double>(), H5::PredType::NATIVE_DOUBLE);
}

// The rows of a padded batch [B,T,...] within each sequence's length, as `type`, on the batch's device.
at::Tensor packed_rows(const at::Tensor& padded, const at::Tensor& lengths, at::ScalarType type) {
  const at::Tensor l = lengths.to(padded.device(), at::kLong);
  const at::Tensor mask = at::arange(padded.size(1), l.options()).unsqueeze(0) < l.unsqueeze(1);
  const at::Tensor rows = padded.detach().reshape({padded.size(0) * padded.size(1), -1});
  return rows.index_select(0, mask.flatten().nonzero().squeeze(1)).to(type).contiguous();
}

// The same rows on the CPU. They are picked and converted on the batch's device, so only they cross to the host.
at::Tensor unpad(const at::Tensor& padded, const at::Tensor& lengths, at::ScalarType type) {
  return packed_rows(padded, lengths, type).cpu().contiguous();
}

// A gzip level, 0 (none) to 9, checked before any file is made.
int gzip_level(int level, const char* what) {
  if (level < 0 || level > 9)
    throw Error(std::string(what) + " must be a gzip level from 0 (none) to 9, not " + std::to_string(level));
  return level;
}

// Chunk size of uncompressed wide datasets (the posteriors): 4 times HDF5's default chunk cache of 1 MiB.
constexpr hsize_t kDirectChunkBytes = hsize_t(4) << 20;
// Chunk size of the other datasets: HDF5's default chunk cache (compressed wide rows: one deflate call's input).
constexpr hsize_t kCachedChunkBytes = hsize_t(1) << 20;

// A chunk of `bytes` as HDF5's shuffle and deflate filters store it (H5Z_FILTER_SHUFFLE with this element size, then
// H5Z_FILTER_DEFLATE at this level: a zlib stream of the shuffled bytes), so that any HDF5 reader inflates it.
std::vector<unsigned char> shuffled_deflate(const unsigned char* chunk, std::size_t bytes, std::size_t element,
                                            int level) {
  std::vector<unsigned char> shuffled(bytes);
  const std::size_t n = bytes / element;  // whole elements; a chunk is a whole number of rows
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t b = 0; b < element; ++b) shuffled[b * n + i] = chunk[i * element + b];
  uLongf size = compressBound(static_cast<uLong>(bytes));
  std::vector<unsigned char> packed(size);
  if (compress2(packed.data(), &size, shuffled.data(), static_cast<uLong>(bytes), level) != Z_OK)
    throw Error("zlib could not compress a chunk of " + std::to_string(bytes) + " bytes");
  packed.resize(size);
  return packed;
}

// A dataset of rows [n, width...] that grows as rows are appended.
class Appendable {
 public:
  // deflate: gzip level 1-9, 0 for none. Uncompressed rows of `expected_rows` (the rows the file will hold, 0: not
  // known) come in chunks of up to kDirectChunkBytes: larger than HDF5's chunk cache, so that their writes go from the
  // caller's buffer to the file without a copy through the cache, and never filled first (every row gets written).
  // Compressed wide rows of known count (the posteriors) are compressed here, a chunk per CPU thread at once, and
  // written as HDF5's filters would have written them (shuffle, deflate): HDF5 would compress them one chunk at a
  // time on the writing thread, holding its library lock throughout. Their last chunk goes to the file at finish().
  Appendable(H5::Group& file, const std::string& name, const H5::PredType& file_type, hsize_t width, int deflate,
             hsize_t expected_rows = 0)
      : width_(width), row_bytes_(std::max<hsize_t>(1, width) * file_type.getSize()), file_type_(file_type) {
    const int rank = width ? 2 : 1;
    const hsize_t dims[2] = {0, width}, max[2] = {H5S_UNLIMITED, width};
    const bool direct = deflate == 0 && expected_rows > 0;
    const bool packed_here = deflate > 0 && expected_rows > 0 && width > 0;
    const hsize_t fitting = std::max<hsize_t>(1, (direct ? kDirectChunkBytes : kCachedChunkBytes) / row_bytes_);
    const hsize_t chunk_rows = direct || packed_here ? std::min(expected_rows, fitting) : fitting;
    const hsize_t chunk[2] = {chunk_rows, width};
    H5::DSetCreatPropList props;
    props.setChunk(rank, chunk);
    if (direct || packed_here) props.setFillTime(H5D_FILL_TIME_NEVER);
    if (deflate > 0) {
      props.setShuffle();
      props.setDeflate(deflate);
    }
    ds_ = file.createDataSet(name, file_type, H5::DataSpace(rank, dims, max), props);
    if (packed_here) {
      deflate_ = deflate;
      chunk_rows_ = chunk_rows;
      pending_.resize(chunk_rows * row_bytes_);
    }
  }
  void append(const void* data, hsize_t n, const H5::PredType& mem_type) {
    if (n == 0) return;
    if (deflate_ > 0) return append_packed(static_cast<const unsigned char*>(data), n, mem_type);
    const int rank = width_ ? 2 : 1;
    const hsize_t grown[2] = {rows_ + n, width_}, start[2] = {rows_, 0}, count[2] = {n, width_};
    ds_.extend(grown);
    H5::DataSpace space = ds_.getSpace();
    space.selectHyperslab(H5S_SELECT_SET, count, start);
    ds_.write(data, mem_type, H5::DataSpace(rank, count), space);
    rows_ += n;
  }
  void append(const at::Tensor& t) {
    const at::Tensor c = t.contiguous();
    append(c.data_ptr(), c.size(0), native_type(c.scalar_type()));
  }
  // Writes the rows still held back (compressed datasets: a last chunk not yet full); a file is complete only after.
  void finish() {
    if (pending_rows_ == 0) return;
    std::fill(pending_.begin() + static_cast<std::ptrdiff_t>(pending_rows_ * row_bytes_), pending_.end(), 0);
    write_chunks({pending_.data()});
    pending_rows_ = 0;
  }
  hsize_t rows() const { return rows_; }

 private:
  // Rows in the file's type, in whole chunks: a chunk's worth of rows collected (the held-back rows topped up first),
  // then every whole chunk compressed at once; the rest held back for the next append.
  void append_packed(const unsigned char* rows, hsize_t n, const H5::PredType& mem_type) {
    if (!(mem_type == file_type_))
      throw Error("internal: compressed rows of '" + ds_.getObjName() + "' must come in the file's type");
    const hsize_t chunk_bytes = chunk_rows_ * row_bytes_;
    std::vector<const unsigned char*> whole;
    hsize_t left = n;
    if (pending_rows_ > 0) {
      const hsize_t take = std::min(left, chunk_rows_ - pending_rows_);
      std::memcpy(pending_.data() + pending_rows_ * row_bytes_, rows, take * row_bytes_);
      pending_rows_ += take;
      rows += take * row_bytes_;
      left -= take;
      if (pending_rows_ == chunk_rows_) whole.push_back(pending_.data());
    }
    for (; left >= chunk_rows_; left -= chunk_rows_, rows += chunk_bytes) whole.push_back(rows);
    rows_ += n;
    const hsize_t grown[2] = {rows_, width_};
    ds_.extend(grown);
    write_chunks(whole);
    if (pending_rows_ == chunk_rows_) pending_rows_ = 0;
    if (left > 0) {
      std::memcpy(pending_.data() + pending_rows_ * row_bytes_, rows, left * row_bytes_);
      pending_rows_ += left;
    }
  }
  // The next chunks of the dataset, in order, compressed on the CPU threads two chunks per thread at a time (so that
  // the compressed chunks held before their write stay a few MiB).
  void write_chunks(const std::vector<const unsigned char*>& chunks) {
    const std::size_t bytes = chunk_rows_ * row_bytes_, element = file_type_.getSize();
    const std::size_t group = 2 * static_cast<std::size_t>(std::max(1, at::get_num_threads()));
    for (std::size_t first = 0; first < chunks.size(); first += group) {
      std::vector<std::vector<unsigned char>> packed(std::min(group, chunks.size() - first));
      at::parallel_for(0, static_cast<int64_t>(packed.size()), 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) packed[i] = shuffled_deflate(chunks[first + i], bytes, element, deflate_);
      });
      for (const std::vector<unsigned char>& chunk : packed) {
        const hsize_t offset[2] = {chunks_written_ * chunk_rows_, 0};
        if (H5Dwrite_chunk(ds_.getId(), H5P_DEFAULT, 0, offset, chunk.size(), chunk.data()) < 0)
          throw H5::DataSetIException("H5Dwrite_chunk", "could not write chunk " + std::to_string(chunks_written_) +
                                                            " of '" + ds_.getObjName() + "'");
        ++chunks_written_;
      }
    }
  }

  H5::DataSet ds_;
  hsize_t width_, row_bytes_, rows_ = 0;
  H5::PredType file_type_;
  // Compressed here (deflate_ > 0): rows per chunk, the rows held back for the next chunk, the chunks written.
  int deflate_ = 0;
  hsize_t chunk_rows_ = 0, pending_rows_ = 0, chunks_written_ = 0;
  std::vector<unsigned char> pending_;
};

}  // namespace

// ---- models ----

namespace {

// Model parameters in natural units, checked before they are used or written; `where` starts every message (the file,
// and whether it is being read or written).
void check_probability_rows(const at::Tensor& p, const std::string& where, const std::string& name) {
  const at::Tensor finite = at::isfinite(p);
  if (!finite.all().item<bool>())
    throw Error(where + ": " + first_index(name, ~finite) + " is " +
                std::to_string(p.masked_select(~finite)[0].item<double>()) + "; probabilities must be finite");
  const at::Tensor negative = p < 0;
  if (negative.any().item<bool>())
    throw Error(where + ": " + first_index(name, negative) + " = " +
                std::to_string(p.masked_select(negative)[0].item<double>()) +
                " is negative; probabilities must be >= 0");
  const at::Tensor rows = p.dim() == 1 ? p.unsqueeze(0) : p;
  const at::Tensor bad = (rows.sum(1) - 1).abs() > 1e-6;
  if (bad.any().item<bool>()) {
    const int64_t r = bad.nonzero()[0][0].item<int64_t>();
    throw Error(where + ": " + name + (p.dim() == 1 ? "" : " row " + std::to_string(r)) +
                " is not a probability distribution (entries must be >= 0 and sum to 1; sum is " +
                std::to_string(rows[r].sum().item<double>()) + ")");
  }
}

// Means finite; variances finite and large enough that the log-density's 1/variance and mean²/variance are finite in
// float64 (smaller ones would make every score NaN).
void check_gaussian(const at::Tensor& means, const at::Tensor& covars, const std::string& where) {
  const at::Tensor bad_mean = ~at::isfinite(means);
  if (bad_mean.any().item<bool>())
    throw Error(where + ": " + first_index("means", bad_mean) + " is " +
                std::to_string(means.masked_select(bad_mean)[0].item<double>()) + "; means must be finite");
  const at::Tensor bad_var = ~(at::isfinite(covars) & (covars > 0));
  if (bad_var.any().item<bool>()) {
    throw Error(where + ": " + first_index("covars", bad_var) + " = " +
                message::text(covars.masked_select(bad_var)[0].item<double>()) + "; variances must be finite and > 0");
  }
  const at::Tensor tiny = ~at::isfinite(covars.reciprocal()) | ~at::isfinite(means * means / covars);
  if (tiny.any().item<bool>())
    throw Error(where + ": " + first_index("covars", tiny) + " = " +
                message::text(covars.masked_select(tiny)[0].item<double>()) +
                " is too small: 1/variance or mean²/variance overflows float64");
}

// What goes with the parameters: names, vocabulary and state labels sized to the model, a history without NaN.
void check_annotations(const HMMModelFile& m, const std::string& where) {
  const int64_t K = std::visit([](const auto& hmm) { return hmm.num_states(); }, m.model);
  if (const auto* c = std::get_if<CategoricalHMM>(&m.model))
    if (!m.vocabulary.empty() && static_cast<int64_t>(m.vocabulary.size()) != c->num_symbols())
      throw Error(where + ": 'vocabulary' has " + std::to_string(m.vocabulary.size()) + " entries for " +
                  std::to_string(c->num_symbols()) + " symbols");
  if (!m.state_names.empty() && static_cast<int64_t>(m.state_names.size()) != K)
    throw Error(where + ": 'state_names' has " + std::to_string(m.state_names.size()) + " entries for " +
                std::to_string(K) + " states");
  if (!m.state_labels.empty() && static_cast<int64_t>(m.state_labels.size()) != K)
    throw Error(where + ": 'state_labels' has " + std::to_string(m.state_labels.size()) + " entries for " +
                std::to_string(K) + " states");
  for (std::size_t k = 0; k < m.state_labels.size(); ++k)
    if (m.state_labels[k] < 0 || m.state_labels[k] >= K)
      throw Error(where + ": state_labels[" + std::to_string(k) + "] = " + std::to_string(m.state_labels[k]) +
                  " is outside [0, " + std::to_string(K) + ")");
  for (std::size_t i = 0; i < m.log_likelihood_history.size(); ++i)
    if (std::isnan(m.log_likelihood_history[i]))
      throw Error(where + ": log_likelihood_history[" + std::to_string(i) + "] is NaN");
}

void check_model(const HMMModelFile& m, const std::string& where) {
  std::visit(
      [&](const auto& hmm) {
        hmm.check();
        check_probability_rows(hmm.log_start.detach().exp().cpu().to(at::kDouble), where, "startprob");
        check_probability_rows(hmm.log_transitions.detach().exp().cpu().to(at::kDouble), where, "transmat");
        if constexpr (std::is_same_v<std::decay_t<decltype(hmm)>, CategoricalHMM>)
          check_probability_rows(hmm.log_emissions.detach().exp().cpu().to(at::kDouble), where, "emissionprob");
        else
          check_gaussian(hmm.means.detach().cpu().to(at::kDouble), hmm.variances.detach().cpu().to(at::kDouble), where);
      },
      m.model);
  check_annotations(m, where);
}

}  // namespace

HMMModelFile load_hmm(const std::string& path) {
  return h5(path, [&] {
    const H5::H5File f = open_readonly(path);
    if (read_string_attribute(f, path, "format") != "trellis-hmm")
      throw Error(path + ": not a Trellis HMM model (attribute 'format' is not \"trellis-hmm\")");
    if (!f.attrExists("version"))
      throw Error(path + ": no attribute 'version' (a Trellis HMM model has version " + std::to_string(kModelVersion) +
                  ")");
    int64_t version = 0;
    const H5::Attribute a = f.openAttribute("version");
    if (a.getTypeClass() != H5T_INTEGER || a.getSpace().getSimpleExtentNpoints() != 1)
      throw Error(path + ": attribute 'version' must be one integer");
    a.read(H5::PredType::NATIVE_INT64, &version);
    if (version != kModelVersion)
      throw Error(path + ": model format version " + std::to_string(version) + " is not supported (expected " +
                  std::to_string(kModelVersion) + ")");
    const std::string emission = read_string_attribute(f, path, "emission");
    if (emission != "categorical" && emission != "gaussian")
      throw Error(path + ": unknown emission type '" + emission + "' (expected categorical or gaussian)");
    const at::Tensor start = read_doubles(f, path, "startprob", {-1});
    const int64_t K = start.size(0);
    if (K < 1) throw Error(path + ": the model has no states");
    check_probability_rows(start, path, "startprob");
    const at::Tensor trans = read_doubles(f, path, "transmat", {K, K});
    check_probability_rows(trans, path, "transmat");
    HMMModelFile out;
    out.state_names = read_strings(f, path, "state_names");
    out.vocabulary = read_strings(f, path, "vocabulary");
    if (emission == "categorical") {
      const at::Tensor e = read_doubles(f, path, "emissionprob", {K, -1});
      if (e.size(1) < 1) throw Error(path + ": 'emissionprob' has no symbols (shape [" + std::to_string(K) + ", 0])");
      check_probability_rows(e, path, "emissionprob");
      out.model = CategoricalHMM{start.log(), trans.log(), e.log()};
    } else {
      const at::Tensor means = read_doubles(f, path, "means", {K, -1});
      if (means.size(1) < 1) throw Error(path + ": 'means' has no features (shape [" + std::to_string(K) + ", 0])");
      const at::Tensor covars = read_doubles(f, path, "covars", {K, means.size(1)});
      check_gaussian(means, covars, path);
      out.model = GaussianHMM{start.log(), trans.log(), means, covars};
    }
    if (exists(f, "state_labels")) {
      const at::Tensor l = read_doubles(f, path, "state_labels", {K});
      const at::Tensor bad = ~at::isfinite(l) | (l != l.round()) | (l < 0) | (l >= K);
      if (bad.any().item<bool>())
        throw Error(path + ": " + first_index("state_labels", bad) + " = " +
                    message::text(l.masked_select(bad)[0].item<double>()) + " is not a label id in [0, " +
                    std::to_string(K) + ")");
      const at::Tensor ids = l.to(at::kLong);
      out.state_labels.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + K);
    }
    if (exists(f, "log_likelihood_history")) {
      const at::Tensor h = read_doubles(f, path, "log_likelihood_history", {-1});
      out.log_likelihood_history.assign(h.data_ptr<double>(), h.data_ptr<double>() + h.numel());
    }
    check_annotations(out, path);
    return out;
  });
}

void save_hmm(const std::string& path, const HMMModelFile& m) {
  check_model(m, path + ": not written");
  H5Output out(path);
  out.write_void([&] {
    H5::Group& f = out.root();
    write_attribute(f, "format", "trellis-hmm");
    const int64_t version = kModelVersion;
    f.createAttribute("version", H5::PredType::STD_I64LE, H5::DataSpace(H5S_SCALAR))
        .write(H5::PredType::NATIVE_INT64, &version);
    std::visit(
        [&](const auto& hmm) {
          write_doubles(f, "startprob", hmm.log_start.exp());
          write_doubles(f, "transmat", hmm.log_transitions.exp());
          if constexpr (std::is_same_v<std::decay_t<decltype(hmm)>, CategoricalHMM>) {
            write_attribute(f, "emission", "categorical");
            write_doubles(f, "emissionprob", hmm.log_emissions.exp());
          } else {
            write_attribute(f, "emission", "gaussian");
            write_doubles(f, "means", hmm.means);
            write_doubles(f, "covars", hmm.variances);
          }
        },
        m.model);
    write_strings(f, "state_names", m.state_names);
    write_strings(f, "vocabulary", m.vocabulary);
    if (!m.state_labels.empty()) write_int64s(f, "state_labels", m.state_labels);
    if (!m.log_likelihood_history.empty())
      write_doubles(f, "log_likelihood_history", at::tensor(m.log_likelihood_history, at::kDouble));
  });
  out.commit();
}

std::vector<std::string> read_string_dataset(const std::string& path, const std::string& name) {
  return h5(path, [&] { return read_strings(open_readonly(path), path, name); });
}

// ---- datasets ----

namespace {

// Integer datasets stored as unsigned 64-bit integers are read as such (HDF5 would clamp values of 2^63 and more to
// int64's largest value): such values land in int64 tensors as negative numbers, reported with their stored value.
bool unsigned64(const H5::DataSet& ds) {
  const H5::IntType t = ds.getIntType();
  return t.getSign() == H5T_SGN_NONE && t.getSize() == 8;
}

std::string stored_value(int64_t v, bool is_unsigned64) {
  return is_unsigned64 ? std::to_string(static_cast<uint64_t>(v)) : std::to_string(v);
}

}  // namespace

struct HMMDataset::Impl {
  std::string path;
  H5::H5File file;
  H5::DataSet observations, labels;
  bool categorical = true, has_labels = false, float64 = false;
  bool observations_unsigned64 = false, labels_unsigned64 = false;
  int64_t features = 0, symbols = 0, label_count = 0;
  std::vector<int64_t> offsets;
  // The range being read ahead (prefetch) and its batch; the future is the last member, so that the thread reading
  // ahead is waited for before anything it reads goes.
  struct Range {
    int64_t first, count;
    bool with_labels;
  };
  mutable std::optional<Range> ahead;
  mutable std::future<SequenceBatch> ahead_batch;

  SequenceBatch read_batch(int64_t first, int64_t count, bool with_labels) const;

  std::string where(const std::string& dataset, int64_t row) const {
    return path + ": /" + dataset + "[" + std::to_string(row) + "]";
  }

  at::Tensor read_rows(const H5::DataSet& ds, int64_t begin, int64_t n, at::ScalarType type, int64_t width,
                       const H5::PredType& memory_type) const {
    at::Tensor out = width ? at::empty({n, width}, type) : at::empty({n}, type);
    if (n == 0) return out;
    const int rank = width ? 2 : 1;
    const hsize_t start[2] = {static_cast<hsize_t>(begin), 0},
                  count[2] = {static_cast<hsize_t>(n), static_cast<hsize_t>(width)};
    H5::DataSpace space = ds.getSpace();
    space.selectHyperslab(H5S_SELECT_SET, count, start);
    ds.read(out.data_ptr(), memory_type, H5::DataSpace(rank, count), space);
    return out;
  }

  // Rows [begin, begin + n) of an integer dataset: ids, each >= 0 and, when bound > 0, below bound.
  at::Tensor read_ids(const H5::DataSet& ds, bool is_unsigned64, const std::string& name, int64_t begin, int64_t n,
                      int64_t bound, const std::string& what) const {
    const at::Tensor ids =
        read_rows(ds, begin, n, at::kLong, 0, is_unsigned64 ? H5::PredType::NATIVE_UINT64 : H5::PredType::NATIVE_INT64);
    const at::Tensor bad = bound > 0 ? (ids < 0) | (ids >= bound) : ids < 0;
    if (bad.any().item<bool>()) {
      const int64_t r = bad.nonzero()[0][0].item<int64_t>();
      const int64_t v = ids[r].item<int64_t>();
      throw Error(where(name, begin + r) + " = " + stored_value(v, is_unsigned64) +
                  (bound > 0 ? " is outside " + what + " [0, " + std::to_string(bound) + ")"
                             : " is not an id (ids count from 0 and are below 2^63)"));
    }
    return ids;
  }
};

HMMDataset::HMMDataset(const std::string& path) : impl_(std::make_unique<Impl>()) {
  Impl& d = *impl_;
  d.path = path;
  h5(path, [&] {
    d.file = open_readonly(path);
    const H5::DataSet off = open_dataset(d.file, path, "offsets");
    d.observations = open_dataset(d.file, path, "observations");
    const auto od = dims_of(off);
    if (off.getTypeClass() != H5T_INTEGER || od.size() != 1 || od[0] < 1)
      throw Error(path + ": '/offsets' must be a 1-d integer dataset of N+1 >= 1 entries");
    check_readable(path, "offsets", od, sizeof(int64_t));
    // Offsets increase strictly from 0 to the observations' rows: at most rows + 1 of them, checked before they are
    // read (a small file can claim billions of unwritten entries).
    const auto observation_dims = dims_of(d.observations);
    if (!observation_dims.empty() && od[0] > observation_dims[0] + 1)
      throw Error(path + ": '/offsets' has " + std::to_string(od[0]) + " entries for " +
                  std::to_string(observation_dims[0]) + " observation rows (at most rows + 1)");
    d.offsets.resize(od[0]);
    const bool offsets_unsigned64 = unsigned64(off);
    off.read(d.offsets.data(), offsets_unsigned64 ? H5::PredType::NATIVE_UINT64 : H5::PredType::NATIVE_INT64);

    const auto dims = dims_of(d.observations);
    const H5T_class_t cls = d.observations.getTypeClass();
    if (cls == H5T_INTEGER) {
      if (dims.size() != 1)
        throw Error(path + ": categorical '/observations' must be 1-d [total_T]; it has rank " +
                    std::to_string(dims.size()));
      d.observations_unsigned64 = unsigned64(d.observations);
    } else if (cls == H5T_FLOAT) {
      if (dims.size() != 2)
        throw Error(path + ": continuous '/observations' must be 2-d [total_T, F]; it has rank " +
                    std::to_string(dims.size()));
      if (dims[1] < 1) throw Error(path + ": continuous '/observations' has no features (F = 0)");
      d.categorical = false;
      d.features = dims[1];
      d.float64 = d.observations.getFloatType().getSize() > 4;
    } else {
      throw Error(path + ": '/observations' must hold integers (symbol ids) or floats (feature vectors)");
    }
    // Read a batch at a time, but a batch of unwritten numbers is as large as the file claims.
    check_stored(path, "observations", d.observations, d.categorical ? sizeof(int64_t) : (d.float64 ? 8.0 : 4.0));
    const int64_t rows = dims[0];
    if (d.offsets[0] != 0)
      throw Error(d.where("offsets", 0) + " = " + stored_value(d.offsets[0], offsets_unsigned64) + ", expected 0");
    for (std::size_t i = 1; i < d.offsets.size(); ++i)
      if (d.offsets[i] <= d.offsets[i - 1])
        throw Error(d.where("offsets", i) + " = " + stored_value(d.offsets[i], offsets_unsigned64) +
                    " is not greater than offsets[" + std::to_string(i - 1) +
                    "] = " + std::to_string(d.offsets[i - 1]) +
                    (d.offsets[i] == d.offsets[i - 1] ? " (sequence " + std::to_string(i - 1) + " is empty)"
                                                      : " (offsets must increase)"));
    if (d.offsets.back() != rows)
      throw Error(path + ": '/offsets' ends at " + std::to_string(d.offsets.back()) + " but '/observations' has " +
                  std::to_string(rows) + " rows");
    if (exists(d.file, "labels")) {
      d.labels = open_dataset(d.file, path, "labels");
      const auto ld = dims_of(d.labels);
      if (d.labels.getTypeClass() != H5T_INTEGER || ld.size() != 1 || static_cast<int64_t>(ld[0]) != rows)
        throw Error(path + ": '/labels' must be a 1-d integer dataset with one entry per observation row (" +
                    std::to_string(rows) + ")");
      check_stored(path, "labels", d.labels, sizeof(int64_t));
      d.labels_unsigned64 = unsigned64(d.labels);
      d.has_labels = true;
    }
  });
}

HMMDataset::~HMMDataset() = default;
HMMDataset::HMMDataset(HMMDataset&&) noexcept = default;
HMMDataset& HMMDataset::operator=(HMMDataset&&) noexcept = default;

const std::string& HMMDataset::path() const { return impl_->path; }
bool HMMDataset::categorical() const { return impl_->categorical; }
int64_t HMMDataset::num_features() const { return impl_->features; }
int64_t HMMDataset::num_sequences() const { return static_cast<int64_t>(impl_->offsets.size()) - 1; }
int64_t HMMDataset::num_tokens() const { return impl_->offsets.back(); }
bool HMMDataset::has_labels() const { return impl_->has_labels; }
const std::vector<int64_t>& HMMDataset::offsets() const { return impl_->offsets; }
std::vector<std::string> HMMDataset::vocabulary() const {
  return h5(impl_->path, [&] { return read_strings(impl_->file, impl_->path, "vocabulary"); });
}
std::vector<std::string> HMMDataset::label_names() const {
  return h5(impl_->path, [&] { return read_strings(impl_->file, impl_->path, "label_names"); });
}
void HMMDataset::expect_symbols(int64_t n) { impl_->symbols = n; }
void HMMDataset::expect_labels(int64_t n) { impl_->label_count = n; }

SequenceBatch HMMDataset::read(int64_t first, int64_t count, bool with_labels) const {
  const Impl& d = *impl_;
  if (d.ahead_batch.valid()) {
    const Impl::Range r = *d.ahead;
    std::future<SequenceBatch> batch = std::move(d.ahead_batch);
    d.ahead.reset();
    if (r.first == first && r.count == count && r.with_labels == with_labels) return batch.get();
    batch.wait();  // another range was read ahead: it (or its error) is dropped
  }
  return d.read_batch(first, count, with_labels);
}

void HMMDataset::prefetch(int64_t first, int64_t count, bool with_labels) const {
  const Impl& d = *impl_;
  hbool_t thread_safe = false;
  if (H5is_library_threadsafe(&thread_safe) < 0 || !thread_safe) return;
  if (d.ahead_batch.valid()) d.ahead_batch.wait();
  d.ahead = Impl::Range{first, count, with_labels};
  d.ahead_batch = std::async(std::launch::async,
                             [&d, first, count, with_labels] { return d.read_batch(first, count, with_labels); });
}

SequenceBatch HMMDataset::Impl::read_batch(int64_t first, int64_t count, bool with_labels) const {
  const Impl& d = *this;
  const int64_t num_sequences = static_cast<int64_t>(offsets.size()) - 1;
  if (first < 0 || count < 1 || first + count > num_sequences)
    throw Error(d.path + ": sequences [" + std::to_string(first) + ", " + std::to_string(first + count) +
                ") are outside [0, " + std::to_string(num_sequences) + ")");
  if (with_labels && !d.has_labels) throw Error(d.path + ": no '/labels' dataset");
  const int64_t begin = d.offsets[first], n = d.offsets[first + count] - begin;
  std::vector<int64_t> len(count);
  for (int64_t i = 0; i < count; ++i) len[i] = d.offsets[first + i + 1] - d.offsets[first + i];
  const int64_t T = *std::max_element(len.begin(), len.end());
  SequenceBatch b;
  b.first = first;
  b.lengths = at::tensor(len, at::kLong);
  // Flat row r of sequence i goes to padded position i*T + (r - start of i).
  const at::Tensor seq = at::repeat_interleave(b.lengths);
  const at::Tensor starts = b.lengths.cumsum(0) - b.lengths;
  const at::Tensor target = seq * T + (at::arange(n, at::kLong) - starts.index_select(0, seq));
  h5(d.path, [&] {
    if (d.categorical) {
      const at::Tensor ids =
          d.read_ids(d.observations, d.observations_unsigned64, "observations", begin, n, d.symbols, "the vocabulary");
      b.observations = at::zeros({count * T}, at::kLong).index_copy_(0, target, ids).view({count, T});
    } else {
      const at::ScalarType type = d.float64 ? at::kDouble : at::kFloat;
      const at::Tensor x = d.read_rows(d.observations, begin, n, type, d.features, native_type(type));
      // A Gaussian's log-density squares each feature: a square beyond the type's range would read as probability 0
      // under every state, blamed on the model.
      const at::Tensor bad = ~at::isfinite(x * x);
      if (bad.any().item<bool>()) {
        const at::Tensor i = bad.nonzero()[0];
        const double v = x[i[0]][i[1]].item<double>();
        throw Error(d.where("observations", begin + i[0].item<int64_t>()) + "[" + std::to_string(i[1].item<int64_t>()) +
                    "] is " +
                    (std::isnan(v)   ? std::string("NaN")
                     : std::isinf(v) ? std::string("infinite")
                                     : message::text(v) + ", too large: its square overflows " +
                                           (d.float64 ? "float64" : "float32")));
      }
      b.observations =
          at::zeros({count * T, d.features}, x.options()).index_copy_(0, target, x).view({count, T, d.features});
    }
    if (with_labels) {
      const at::Tensor ids = d.read_ids(d.labels, d.labels_unsigned64, "labels", begin, n, d.label_count, "the states");
      b.labels = at::full({count * T}, -1, at::kLong).index_copy_(0, target, ids).view({count, T});
    }
  });
  return b;
}

std::vector<std::pair<int64_t, int64_t>> HMMDataset::batches(int64_t max_tokens) const {
  std::vector<std::pair<int64_t, int64_t>> out;
  const auto& o = impl_->offsets;
  int64_t first = 0;
  int64_t T = 0;  // a batch costs (sequences × longest length) positions, padding included
  for (int64_t i = 0; i < num_sequences(); ++i) {
    const int64_t len = o[i + 1] - o[i];
    const int64_t grown = std::max(T, len) * (i - first + 1);
    if (i > first && grown > max_tokens) {
      out.emplace_back(first, i - first);
      first = i;
      T = 0;
    }
    T = std::max(T, len);
  }
  if (num_sequences() > first) out.emplace_back(first, num_sequences() - first);
  return out;
}

// ---- writers ----

struct HMMDatasetWriter::Impl {
  H5Output out;
  Appendable observations;
  std::unique_ptr<Appendable> labels;
  std::vector<int64_t> offsets{0};
  int64_t features;

  Impl(const std::string& path, int64_t f, bool with_labels)
      : out(path), observations(out.write([&] {
          return Appendable(out.root(), "observations", f ? H5::PredType::IEEE_F32LE : H5::PredType::STD_I32LE, f, 0);
        })),
        features(f) {
    if (with_labels)
      labels = out.write(
          [&] { return std::make_unique<Appendable>(out.root(), "labels", H5::PredType::STD_I32LE, 0, false); });
  }
};

HMMDatasetWriter::HMMDatasetWriter(const std::string& path, int64_t num_features, bool with_labels)
    : impl_(std::make_unique<Impl>(path, num_features, with_labels)) {}
HMMDatasetWriter::~HMMDatasetWriter() = default;

void HMMDatasetWriter::append(const at::Tensor& observations, const at::Tensor& lengths, const at::Tensor& labels) {
  Impl& w = *impl_;
  if ((w.labels != nullptr) != labels.defined())
    throw Error(w.out.path() + ": labels must be given with every batch, or never");
  const at::Tensor l = lengths.cpu().to(at::kLong);
  if ((l < 1).any().item<bool>()) throw Error(w.out.path() + ": empty sequences cannot be written");
  const at::Tensor rows = unpad(observations, l, observations.scalar_type());
  const at::Tensor label_rows = w.labels ? unpad(labels, l, labels.scalar_type()) : at::Tensor();
  // Ids are stored as int32.
  for (const at::Tensor* ids : {w.features ? nullptr : &rows, w.labels ? &label_rows : nullptr})
    if (ids && ids->numel() && (ids->min().item<int64_t>() < 0 || ids->max().item<int64_t>() > INT32_MAX))
      throw Error(w.out.path() + ": ids must lie in [0, 2^31) to be written");
  w.out.write_void([&] {
    w.observations.append(w.features ? rows.to(at::kFloat) : rows.to(at::kInt).squeeze(1));
    if (w.labels) w.labels->append(label_rows.to(at::kInt).squeeze(1));
  });
  for (int64_t i = 0; i < l.size(0); ++i) w.offsets.push_back(w.offsets.back() + l[i].item<int64_t>());
}

void HMMDatasetWriter::write_strings(const std::string& name, const std::vector<std::string>& values) {
  impl_->out.write_void([&] { trellis::write_strings(impl_->out.root(), name, values); });
}

void HMMDatasetWriter::commit() {
  Impl& w = *impl_;
  w.out.write_void([&] { write_int64s(w.out.root(), "offsets", w.offsets); });
  w.out.commit();
}

// Bytes of posteriors per HDF5 write: HDF5's library lock is held for one write, so that a read of the dataset on
// another thread waits for one slice at most. Posteriors computed on a GPU also cross to the host a slice at a time.
constexpr int64_t kPosteriorSliceBytes = int64_t(64) << 20;

struct HMMInferenceWriter::Impl {
  // One batch as it goes to the file: tensors in the file's types, on the host but for the posteriors of a batch
  // computed on a GPU, which stay there until they are written (`posteriors_ready` is recorded on the stream that
  // formed them).
  struct Batch {
    at::Tensor log_likelihood, viterbi, states, labels, posteriors;
    std::optional<c10::Event> posteriors_ready;
  };

  H5Output out;
  Appendable log_likelihood, viterbi, states;
  std::unique_ptr<Appendable> posteriors, labels;
  at::Tensor state_labels;
  // With posteriors (and an HDF5 built thread-safe), batches are written on a thread of their own while the caller
  // computes the next. One batch waits at most while another is written (two batches' host copies at most); posteriors
  // on a GPU are handed over only once the writer is idle, so that the device holds one batch's beyond the
  // computation.
  std::mutex mutex;
  std::condition_variable changed;
  std::optional<Batch> waiting;
  bool writing = false, closing = false;
  std::exception_ptr failure;  // the first failed write's Error
  std::thread writer;
  // Two pinned host buffers of one slice of GPU posteriors each: one slice is copied into one while the other's is
  // written, so that the copy runs at the link's speed (not a pageable copy's) and beside the file's writes.
  std::array<at::Tensor, 2> staging;

  // A batch's results in the file's types: log-likelihoods and Viterbi scores (float64), the paths' states and labels
  // (int32) and the posteriors (float32), without the padding.
  Batch host_batch(const at::Tensor& ll, const at::Tensor& viterbi_log_prob, const at::Tensor& paths,
                   const at::Tensor& lengths, const at::Tensor& nodes) const {
    Batch b;
    b.log_likelihood = ll.detach().cpu().to(at::kDouble).contiguous();
    b.viterbi = viterbi_log_prob.detach().cpu().to(at::kDouble).contiguous();
    if (posteriors && nodes.is_cuda()) {
      b.posteriors = packed_rows(nodes, lengths, at::kFloat);
      b.posteriors_ready.emplace(c10::DeviceType::CUDA);
      b.posteriors_ready->record(c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(nodes.device()));
    } else if (posteriors) {
      b.posteriors = unpad(nodes, lengths, at::kFloat);
    }
    const at::Tensor path = unpad(paths, lengths, at::kLong).squeeze(1);
    b.states = path.to(at::kInt);
    if (labels) b.labels = state_labels.index_select(0, path).to(at::kInt);
    return b;
  }

  // Posteriors rows [N,K] on a GPU: each slice copied into a pinned buffer on a stream of its own (after the stream
  // that formed them reached `ready`), the next slice's copy started before this one's write.
  void write_device_posteriors(const at::Tensor& rows, const c10::Event& ready) {
    const int64_t total = rows.size(0);
    if (total == 0) return;
    const int64_t slice = std::max<int64_t>(1, kPosteriorSliceBytes / (rows.size(1) * rows.element_size()));
    const int64_t buffer_rows = std::min(slice, total);
    for (at::Tensor& s : staging)
      if (!s.defined() || s.size(0) < buffer_rows || s.size(1) != rows.size(1))
        s = at::empty({buffer_rows, rows.size(1)}, rows.options().device(at::kCPU).pinned_memory(true));
    const c10::Stream copies =
        c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStreamFromGlobalPool(rows.device());
    ready.block(copies);
    const c10::StreamGuard on_copies(copies);
    std::array<c10::Event, 2> landed{c10::Event(c10::DeviceType::CUDA), c10::Event(c10::DeviceType::CUDA)};
    const auto start_copy = [&](int64_t first, int slot) {
      const int64_t n = std::min(slice, total - first);
      staging[slot].narrow(0, 0, n).copy_(rows.narrow(0, first, n), /*non_blocking=*/true);
      landed[slot].record(copies);
    };
    try {
      start_copy(0, 0);
      for (int64_t first = 0, i = 0; first < total; first += slice, ++i) {
        const int slot = static_cast<int>(i % 2);
        // The other buffer's slice has been written (append returns once the bytes are in the file).
        if (first + slice < total) start_copy(first + slice, 1 - slot);
        landed[slot].synchronize();
        out.write_void([&] { posteriors->append(staging[slot].narrow(0, 0, std::min(slice, total - first))); });
      }
    } catch (...) {
      copies.synchronize();  // no copy into the buffers or out of `rows` outlives this batch
      throw;
    }
  }

  void write(const Batch& b) {
    out.write_void([&] {
      log_likelihood.append(b.log_likelihood);
      viterbi.append(b.viterbi);
      states.append(b.states);
      if (labels) labels->append(b.labels);
      if (posteriors && !b.posteriors_ready) {
        const int64_t rows = b.posteriors.size(0);
        const int64_t slice = std::max<int64_t>(
            1, kPosteriorSliceBytes / std::max<int64_t>(1, b.posteriors.stride(0) * b.posteriors.element_size()));
        for (int64_t r = 0; r < rows; r += slice)
          posteriors->append(b.posteriors.slice(0, r, std::min(rows, r + slice)));
      }
    });
    if (posteriors && b.posteriors_ready) write_device_posteriors(b.posteriors, *b.posteriors_ready);
    out.start_writeback();
  }

  void run() {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      changed.wait(lock, [&] { return closing || waiting; });
      if (!waiting) return;
      std::optional<Batch> batch = std::exchange(waiting, std::nullopt);
      writing = true;
      const bool failed = failure != nullptr;
      lock.unlock();
      std::exception_ptr error;
      if (!failed) {
        try {
          write(*batch);
        } catch (...) {
          error = std::current_exception();
        }
      }
      batch.reset();  // the host copy goes before the next batch's comes
      lock.lock();
      writing = false;
      if (error && !failure) failure = error;
      changed.notify_all();
    }
  }

  // Stops the writer thread: after the batches given so far are written (finish) or after the one being written.
  void stop(bool finish) {
    if (!writer.joinable()) return;
    {
      std::unique_lock<std::mutex> lock(mutex);
      if (finish) changed.wait(lock, [&] { return !waiting && !writing; });
      waiting.reset();
      closing = true;
    }
    changed.notify_all();
    writer.join();
  }
  ~Impl() { stop(/*finish=*/false); }

  Impl(const std::string& path, const std::vector<int64_t>& offsets, int64_t k, bool with_posteriors,
       const std::vector<int64_t>& state_label_ids, int posteriors_compression)
      : out(path), log_likelihood(out.write(
                       [&] { return Appendable(out.root(), "log_likelihood", H5::PredType::IEEE_F64LE, 0, 0); })),
        viterbi(out.write([&] { return Appendable(out.root(), "viterbi_log_prob", H5::PredType::IEEE_F64LE, 0, 0); })),
        states(out.write([&] { return Appendable(out.root(), "states", H5::PredType::STD_I32LE, 0, 0); })) {
    out.write_void([&] {
      write_int64s(out.root(), "offsets", offsets);
      if (with_posteriors)
        posteriors =
            std::make_unique<Appendable>(out.root(), "posteriors", H5::PredType::IEEE_F32LE, k, posteriors_compression,
                                         static_cast<hsize_t>(offsets.empty() ? 0 : offsets.back()));
      if (!state_label_ids.empty()) {
        labels = std::make_unique<Appendable>(out.root(), "labels", H5::PredType::STD_I32LE, 0, 0);
        state_labels = at::tensor(state_label_ids, at::kLong);
      }
    });
    hbool_t thread_safe = false;
    if (with_posteriors && H5is_library_threadsafe(&thread_safe) >= 0 && thread_safe)
      writer = std::thread([this] { run(); });
  }
};

HMMInferenceWriter::HMMInferenceWriter(const std::string& path, const std::vector<int64_t>& offsets, int64_t K,
                                       bool with_posteriors, const std::vector<int64_t>& state_labels,
                                       int posteriors_compression)
    : impl_(std::make_unique<Impl>(path, offsets, K, with_posteriors, state_labels,
                                   gzip_level(posteriors_compression, "posteriors compression"))) {}
HMMInferenceWriter::~HMMInferenceWriter() = default;

void HMMInferenceWriter::append(const at::Tensor& log_likelihood, const at::Tensor& viterbi_log_prob,
                                const at::Tensor& paths, const at::Tensor& lengths, const at::Tensor& posteriors) {
  Impl& w = *impl_;
  if ((w.posteriors != nullptr) != posteriors.defined())
    throw Error(w.out.path() + ": posteriors must be given with every batch, or never");
  if (!w.writer.joinable()) {
    w.write(w.host_batch(log_likelihood, viterbi_log_prob, paths, lengths, posteriors));
    return;
  }
  const bool on_device = posteriors.defined() && posteriors.is_cuda();
  {
    std::unique_lock<std::mutex> lock(w.mutex);
    w.changed.wait(lock, [&] { return w.failure || (!w.waiting && !(on_device && w.writing)); });
    if (w.failure) std::rethrow_exception(w.failure);
  }
  Impl::Batch batch = w.host_batch(log_likelihood, viterbi_log_prob, paths, lengths, posteriors);
  {
    const std::lock_guard<std::mutex> lock(w.mutex);
    w.waiting = std::move(batch);
  }
  w.changed.notify_all();
}

void HMMInferenceWriter::commit() {
  Impl& w = *impl_;
  w.stop(/*finish=*/true);
  if (w.failure) std::rethrow_exception(w.failure);
  if (w.posteriors) w.out.write_void([&] { w.posteriors->finish(); });
  w.out.commit();
}

at::Tensor read_posteriors(const std::string& path, int64_t first, int64_t count) {
  return h5(path, [&] {
    const H5::H5File f = open_readonly(path);
    const H5::DataSet ds = open_dataset(f, path, "posteriors");
    const auto d = dims_of(ds);
    if (d.size() != 2 || ds.getTypeClass() != H5T_FLOAT)
      throw Error(path + ": '/posteriors' must be a 2-d array of floating-point numbers");
    if (first < 0 || count < 0 || first > static_cast<int64_t>(d[0]) || count > static_cast<int64_t>(d[0]) - first)
      throw Error(path + ": '/posteriors' holds " + std::to_string(d[0]) + " rows, not " + std::to_string(count) +
                  " rows from row " + std::to_string(first));
    at::Tensor rows = at::empty({count, static_cast<int64_t>(d[1])}, at::kFloat);
    if (count == 0) return rows;
    const hsize_t start[2] = {static_cast<hsize_t>(first), 0}, size[2] = {static_cast<hsize_t>(count), d[1]};
    H5::DataSpace space = ds.getSpace();
    space.selectHyperslab(H5S_SELECT_SET, size, start);
    ds.read(rows.data_ptr<float>(), H5::PredType::NATIVE_FLOAT, H5::DataSpace(2, size), space);
    return rows;
  });
}

// ---- evaluation ----

LabelAccuracy score_predictions(HMMDataset& data, const std::string& predictions, bool coarse) {
  if (!data.has_labels()) throw Error(data.path() + ": no '/labels' dataset to score against");
  // Label id -> the id of its coarse class (the name's part before '|'), or itself.
  std::vector<int64_t> klass;
  if (coarse) {
    const std::vector<std::string> names = data.label_names();
    if (names.empty()) throw Error(data.path() + ": --coarse scoring needs the dataset's '/label_names'");
    std::unordered_map<std::string, int64_t> ids;
    for (const auto& n : names) klass.push_back(ids.emplace(n.substr(0, n.find('|')), ids.size()).first->second);
  }
  return h5(predictions, [&] {
    const H5::H5File f = open_readonly(predictions);
    if (!exists(f, "states")) throw Error(predictions + ": no '/states': not an output of trellis hmm infer");
    const std::string predicted = exists(f, "labels") ? "labels" : "states";
    const H5::DataSet off = open_dataset(f, predictions, "offsets"), states = open_dataset(f, predictions, predicted);
    if (states.getTypeClass() != H5T_INTEGER)
      throw Error(predictions + ": '/" + predicted + "' must hold integers (state ids)");
    const auto od = dims_of(off), sd = dims_of(states);
    if (od.size() != 1 || od[0] != data.offsets().size())
      throw Error(predictions + ": its '/offsets' differ from those of " + data.path() +
                  " (predictions of other data?)");
    std::vector<int64_t> o(od[0]);
    off.read(o.data(), H5::PredType::NATIVE_INT64);
    if (o != data.offsets())
      throw Error(predictions + ": its '/offsets' differ from those of " + data.path() +
                  " (predictions of other data?)");
    if (sd.size() != 1 || static_cast<int64_t>(sd[0]) != o.back())
      throw Error(predictions + ": '/" + predicted + "' must be 1-d with one entry per token (" +
                  std::to_string(o.back()) + ")");
    const H5::DataSet labels = H5::H5File(data.path(), H5F_ACC_RDONLY).openDataSet("labels");
    LabelAccuracy acc;
    constexpr int64_t kChunk = 1 << 20;
    for (int64_t begin = 0; begin < o.back(); begin += kChunk) {
      const hsize_t start = begin, count = std::min(kChunk, o.back() - begin);
      std::vector<int64_t> a(count), b(count);
      H5::DataSpace sa = states.getSpace(), sb = labels.getSpace();
      sa.selectHyperslab(H5S_SELECT_SET, &count, &start);
      sb.selectHyperslab(H5S_SELECT_SET, &count, &start);
      states.read(a.data(), H5::PredType::NATIVE_INT64, H5::DataSpace(1, &count), sa);
      labels.read(b.data(), H5::PredType::NATIVE_INT64, H5::DataSpace(1, &count), sb);
      for (hsize_t i = 0; i < count; ++i) {
        // -1: a sequence no state path can produce (infer's path there); anything below is no state.
        if (a[i] < -1)
          throw Error(predictions + ": '/" + predicted + "'[" + std::to_string(begin + i) + "] = " +
                      std::to_string(a[i]) + " is not a state id");
        if (b[i] < 0)
          throw Error(data.path() + ": '/labels'[" + std::to_string(begin + i) + "] = " + std::to_string(b[i]) +
                      " is not a label id");
        if (coarse && (a[i] < 0 || b[i] < 0 || a[i] >= int64_t(klass.size()) || b[i] >= int64_t(klass.size())))
          throw Error(predictions + ": label id out of range of " + data.path() + "'s label names at token " +
                      std::to_string(begin + i));
        acc.correct += coarse ? klass[a[i]] == klass[b[i]] : a[i] == b[i];
      }
      acc.tokens += count;
    }
    return acc;
  });
}

}  // namespace trellis
