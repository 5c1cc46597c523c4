#include "trellis/hmm_io.h"

#include <H5Cpp.h>
#include <unistd.h>  // getpid, for temporary file names

#include <ATen/ATen.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <unordered_map>

#include "trellis/error.h"

namespace trellis {
namespace {

constexpr int64_t kModelVersion = 1;

// Runs f, turning HDF5's exceptions (which are not std::exceptions) into Errors that name the file.
template <class F>
auto h5(const std::string& path, F&& f) {
  H5::Exception::dontPrint();
  try {
    return f();
  } catch (const H5::Exception& e) {
    throw Error(path + ": HDF5 error in " + e.getFuncName() + ": " + e.getDetailMsg());
  }
}

// Called inside h5(): a missing or non-HDF5 file gets a plain message instead of an HDF5 error stack.
H5::H5File open_readonly(const std::string& path) {
  if (access(path.c_str(), R_OK) != 0) throw Error("cannot open '" + path + "': " + std::strerror(errno));
  if (H5::H5File::isHdf5(path.c_str()) <= 0) throw Error(path + ": not an HDF5 file");
  return H5::H5File(path, H5F_ACC_RDONLY);
}

const H5::PredType& native_type(at::ScalarType t) {
  switch (t) {
    case at::kInt: return H5::PredType::NATIVE_INT32;
    case at::kLong: return H5::PredType::NATIVE_INT64;
    case at::kFloat: return H5::PredType::NATIVE_FLOAT;
    case at::kDouble: return H5::PredType::NATIVE_DOUBLE;
    default: throw Error("HDF5: no native type for " + std::string(c10::toString(t)));
  }
}

void write_int64s(H5::H5File& file, const std::string& name, const std::vector<int64_t>& values) {
  const hsize_t n = values.size();
  file.createDataSet(name, H5::PredType::STD_I64LE, H5::DataSpace(1, &n)).write(values.data(), H5::PredType::NATIVE_INT64);
}

bool exists(const H5::H5File& file, const std::string& name) { return H5Lexists(file.getId(), name.c_str(), H5P_DEFAULT) > 0; }

std::vector<hsize_t> dims_of(const H5::DataSet& ds) {
  const H5::DataSpace sp = ds.getSpace();
  std::vector<hsize_t> d(sp.getSimpleExtentNdims());
  sp.getSimpleExtentDims(d.data());
  return d;
}

std::vector<std::string> read_strings(const H5::H5File& file, const std::string& path, const std::string& name) {
  if (!exists(file, name)) return {};
  const H5::DataSet ds = file.openDataSet(name);
  const auto d = dims_of(ds);
  if (ds.getTypeClass() != H5T_STRING || d.size() != 1)
    throw Error(path + ": dataset '" + name + "' must be a 1-d array of strings");
  const H5::StrType type = ds.getStrType();
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

void write_strings(H5::H5File& file, const std::string& name, const std::vector<std::string>& values) {
  if (values.empty()) return;
  H5::StrType type(H5::PredType::C_S1, H5T_VARIABLE);
  type.setCset(H5T_CSET_UTF8);
  std::vector<const char*> raw;
  for (const auto& v : values) raw.push_back(v.c_str());
  const hsize_t n = values.size();
  file.createDataSet(name, type, H5::DataSpace(1, &n)).write(raw.data(), type);
}

std::string read_string_attribute(const H5::H5File& file, const std::string& path, const std::string& name) {
  const H5::Group root = file.openGroup("/");
  if (!root.attrExists(name)) throw Error(path + ": not a Trellis HMM model (no '" + name + "' attribute)");
  const H5::Attribute a = root.openAttribute(name);
  if (a.getTypeClass() != H5T_STRING) throw Error(path + ": attribute '" + name + "' must be a string");
  std::string s;
  a.read(a.getStrType(), s);
  return s;
}

void write_attribute(H5::H5File& file, const std::string& name, const std::string& value) {
  H5::StrType type(H5::PredType::C_S1, H5T_VARIABLE);
  type.setCset(H5T_CSET_UTF8);
  const char* raw = value.c_str();
  file.openGroup("/").createAttribute(name, type, H5::DataSpace(H5S_SCALAR)).write(type, &raw);
}

// A float64 dataset of exactly `shape` (read whole, small).
at::Tensor read_doubles(const H5::H5File& file, const std::string& path, const std::string& name,
                        std::vector<int64_t> shape) {
  if (!exists(file, name)) throw Error(path + ": missing dataset '" + name + "'");
  const H5::DataSet ds = file.openDataSet(name);
  const auto d = dims_of(ds);
  const std::vector<int64_t> got(d.begin(), d.end());
  if (ds.getTypeClass() != H5T_FLOAT && ds.getTypeClass() != H5T_INTEGER)
    throw Error(path + ": dataset '" + name + "' must hold numbers");
  bool fits = got.size() == shape.size();
  for (std::size_t i = 0; fits && i < shape.size(); ++i) fits = shape[i] < 0 || got[i] == shape[i];
  if (!fits)
      throw Error(path + ": dataset '" + name + "' has shape " + c10::str(at::IntArrayRef(got)) + ", expected " +
                  c10::str(at::IntArrayRef(shape)) + " (-1: any size)");
  at::Tensor t = at::empty(got, at::kDouble);
  ds.read(t.data_ptr<double>(), H5::PredType::NATIVE_DOUBLE);
  return t;
}

// Probability rows: non-negative, finite, each summing to 1.
at::Tensor log_probability_rows(const at::Tensor& p, const std::string& path, const std::string& name) {
  const at::Tensor rows = p.dim() == 1 ? p.unsqueeze(0) : p;
  const at::Tensor bad = ~at::isfinite(rows).all(1) | (rows < 0).any(1) | ((rows.sum(1) - 1).abs() > 1e-6);
  if (bad.any().item<bool>()) {
    const int64_t r = bad.nonzero()[0][0].item<int64_t>();
    throw Error(path + ": " + name + (p.dim() == 1 ? "" : " row " + std::to_string(r)) +
                " is not a probability distribution (entries must be >= 0 and sum to 1; sum is " +
                std::to_string(rows[r].sum().item<double>()) + ")");
  }
  return p.log();
}

void write_doubles(H5::H5File& file, const std::string& name, const at::Tensor& t) {
  const at::Tensor c = t.detach().cpu().to(at::kDouble).contiguous();
  std::vector<hsize_t> d(c.sizes().begin(), c.sizes().end());
  file.createDataSet(name, H5::PredType::IEEE_F64LE, H5::DataSpace(d.size(), d.data()))
      .write(c.data_ptr<double>(), H5::PredType::NATIVE_DOUBLE);
}

// The flat rows [n, ...] of a padded batch [B,T,...].
at::Tensor unpad(const at::Tensor& padded, const at::Tensor& lengths) {
  const at::Tensor l = lengths.cpu().to(at::kLong);
  const at::Tensor mask = at::arange(padded.size(1), at::kLong).unsqueeze(0) < l.unsqueeze(1);
  const at::Tensor rows = padded.detach().cpu().reshape({padded.size(0) * padded.size(1), -1});
  return rows.index_select(0, mask.flatten().nonzero().squeeze(1)).contiguous();
}

// A temporary HDF5 file renamed over `path` by commit(); removed if never committed.
class TemporaryH5 {
 public:
  explicit TemporaryH5(std::string path)
      : path_(std::move(path)),
        tmp_(path_ + ".tmp." + std::to_string(::getpid())),
        file_(h5(tmp_, [&] { return H5::H5File(tmp_, H5F_ACC_TRUNC); })) {}
  ~TemporaryH5() {
    if (committed_) return;
    try {
      file_.close();
    } catch (...) {
    }
    std::remove(tmp_.c_str());
  }
  H5::H5File& file() { return file_; }
  const std::string& path() const { return path_; }
  void commit() {
    h5(tmp_, [&] { file_.close(); });
    if (std::rename(tmp_.c_str(), path_.c_str()) != 0)
      throw Error("cannot rename '" + tmp_ + "' to '" + path_ + "': " + std::strerror(errno));
    committed_ = true;
  }

 private:
  std::string path_, tmp_;
  H5::H5File file_;
  bool committed_ = false;
};

// A dataset of rows [n, width...] that grows as rows are appended.
class Appendable {
 public:
  Appendable(H5::H5File& file, const std::string& name, const H5::PredType& file_type, hsize_t width, bool compress)
      : width_(width) {
    const int rank = width ? 2 : 1;
    const hsize_t dims[2] = {0, width}, max[2] = {H5S_UNLIMITED, width};
    const hsize_t row_bytes = std::max<hsize_t>(1, width) * file_type.getSize();
    const hsize_t chunk[2] = {std::max<hsize_t>(1, (1 << 20) / row_bytes), width};
    H5::DSetCreatPropList props;
    props.setChunk(rank, chunk);
    if (compress) {
      props.setShuffle();
      props.setDeflate(4);
    }
    ds_ = file.createDataSet(name, file_type, H5::DataSpace(rank, dims, max), props);
  }
  void append(const void* data, hsize_t n, const H5::PredType& mem_type) {
    if (n == 0) return;
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
  hsize_t rows() const { return rows_; }

 private:
  H5::DataSet ds_;
  hsize_t width_, rows_ = 0;
};

}  // namespace

// ---- models ----

HMMModelFile load_hmm(const std::string& path) {
  return h5(path, [&] {
    const H5::H5File f = open_readonly(path);
    if (read_string_attribute(f, path, "format") != "trellis-hmm")
      throw Error(path + ": not a Trellis HMM model (attribute 'format' is not \"trellis-hmm\")");
    const H5::Group root = f.openGroup("/");
    int64_t version = 0;
    if (root.attrExists("version")) root.openAttribute("version").read(H5::PredType::NATIVE_INT64, &version);
    if (version != kModelVersion)
      throw Error(path + ": model format version " + std::to_string(version) + " is not supported (expected " +
                  std::to_string(kModelVersion) + ")");
    const std::string emission = read_string_attribute(f, path, "emission");
    const at::Tensor start = read_doubles(f, path, "startprob", {-1});
    const int64_t K = start.size(0);
    if (K < 1) throw Error(path + ": the model has no states");
    const at::Tensor log_start = log_probability_rows(start, path, "startprob");
    const at::Tensor log_trans = log_probability_rows(read_doubles(f, path, "transmat", {K, K}), path, "transmat");
    HMMModelFile out;
    out.state_names = read_strings(f, path, "state_names");
    out.vocabulary = read_strings(f, path, "vocabulary");
    if (emission == "categorical") {
      const at::Tensor e = read_doubles(f, path, "emissionprob", {K, -1});
      out.model = CategoricalHMM{log_start, log_trans, log_probability_rows(e, path, "emissionprob")};
    } else if (emission == "gaussian") {
      const at::Tensor means = read_doubles(f, path, "means", {K, -1});
      const at::Tensor covars = read_doubles(f, path, "covars", {K, means.size(1)});
      if (!at::isfinite(means).all().item<bool>()) throw Error(path + ": 'means' holds NaN or inf");
      if (!(at::isfinite(covars) & (covars > 0)).all().item<bool>())
        throw Error(path + ": 'covars' must be finite and > 0");
      out.model = GaussianHMM{log_start, log_trans, means, covars};
    } else {
      throw Error(path + ": unknown emission type '" + emission + "' (expected categorical or gaussian)");
    }
    if (!out.state_names.empty() && static_cast<int64_t>(out.state_names.size()) != K)
      throw Error(path + ": 'state_names' has " + std::to_string(out.state_names.size()) + " entries for " +
                  std::to_string(K) + " states");
    if (exists(f, "state_labels")) {
      const at::Tensor l = read_doubles(f, path, "state_labels", {K}).to(at::kLong);
      out.state_labels.assign(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + K);
    }
    if (exists(f, "log_likelihood_history")) {
      const at::Tensor h = read_doubles(f, path, "log_likelihood_history", {-1});
      out.log_likelihood_history.assign(h.data_ptr<double>(), h.data_ptr<double>() + h.numel());
    }
    return out;
  });
}

void save_hmm(const std::string& path, const HMMModelFile& m) {
  TemporaryH5 out(path);
  h5(path, [&] {
    H5::H5File& f = out.file();
    write_attribute(f, "format", "trellis-hmm");
    const int64_t version = kModelVersion;
    f.openGroup("/").createAttribute("version", H5::PredType::STD_I64LE, H5::DataSpace(H5S_SCALAR))
        .write(H5::PredType::NATIVE_INT64, &version);
    std::visit(
        [&](const auto& hmm) {
          hmm.check();
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
  return h5(path, [&] {
    return read_strings(open_readonly(path), path, name);
  });
}

// ---- datasets ----

struct HMMDataset::Impl {
  std::string path;
  H5::H5File file;
  H5::DataSet observations, labels;
  bool categorical = true, has_labels = false, float64 = false;
  int64_t features = 0, symbols = 0, label_count = 0;
  std::vector<int64_t> offsets;

  std::string where(const std::string& dataset, int64_t row) const {
    return path + ": /" + dataset + "[" + std::to_string(row) + "]";
  }

  at::Tensor read_rows(const H5::DataSet& ds, int64_t begin, int64_t n, at::ScalarType type, int64_t width) const {
    at::Tensor out = width ? at::empty({n, width}, type) : at::empty({n}, type);
    if (n == 0) return out;
    const int rank = width ? 2 : 1;
    const hsize_t start[2] = {static_cast<hsize_t>(begin), 0}, count[2] = {static_cast<hsize_t>(n),
                                                                           static_cast<hsize_t>(width)};
    H5::DataSpace space = ds.getSpace();
    space.selectHyperslab(H5S_SELECT_SET, count, start);
    ds.read(out.data_ptr(), native_type(type), H5::DataSpace(rank, count), space);
    return out;
  }

  // Rows [begin, begin + n) of an integer dataset, each in [0, bound) when bound > 0.
  at::Tensor read_ids(const H5::DataSet& ds, const std::string& name, int64_t begin, int64_t n, int64_t bound,
                      const std::string& what) const {
    const at::Tensor ids = read_rows(ds, begin, n, at::kLong, 0);
    if (bound > 0) {
      const at::Tensor bad = (ids < 0) | (ids >= bound);
      if (bad.any().item<bool>()) {
        const int64_t r = bad.nonzero()[0][0].item<int64_t>();
        throw Error(where(name, begin + r) + " = " + std::to_string(ids[r].item<int64_t>()) + " is outside " + what +
                    " [0, " + std::to_string(bound) + ")");
      }
    }
    return ids;
  }
};

HMMDataset::HMMDataset(const std::string& path) : impl_(std::make_unique<Impl>()) {
  Impl& d = *impl_;
  d.path = path;
  h5(path, [&] {
    d.file = open_readonly(path);
    for (const char* name : {"offsets", "observations"})
      if (!exists(d.file, name)) throw Error(path + ": missing dataset '/" + std::string(name) + "'");
    const H5::DataSet off = d.file.openDataSet("offsets");
    const auto od = dims_of(off);
    if (off.getTypeClass() != H5T_INTEGER || od.size() != 1 || od[0] < 1)
      throw Error(path + ": '/offsets' must be a 1-d integer dataset of N+1 >= 1 entries");
    d.offsets.resize(od[0]);
    off.read(d.offsets.data(), H5::PredType::NATIVE_INT64);

    d.observations = d.file.openDataSet("observations");
    const auto dims = dims_of(d.observations);
    const H5T_class_t cls = d.observations.getTypeClass();
    if (cls == H5T_INTEGER) {
      if (dims.size() != 1)
        throw Error(path + ": categorical '/observations' must be 1-d [total_T]; it has rank " +
                    std::to_string(dims.size()));
    } else if (cls == H5T_FLOAT) {
      if (dims.size() != 2)
        throw Error(path + ": continuous '/observations' must be 2-d [total_T, F]; it has rank " +
                    std::to_string(dims.size()));
      d.categorical = false;
      d.features = dims[1];
      d.float64 = d.observations.getFloatType().getSize() > 4;
    } else {
      throw Error(path + ": '/observations' must hold integers (symbol ids) or floats (feature vectors)");
    }
    const int64_t rows = dims[0];
    if (d.offsets[0] != 0) throw Error(d.where("offsets", 0) + " = " + std::to_string(d.offsets[0]) + ", expected 0");
    for (std::size_t i = 1; i < d.offsets.size(); ++i)
      if (d.offsets[i] <= d.offsets[i - 1])
        throw Error(d.where("offsets", i) + " = " + std::to_string(d.offsets[i]) + " is not greater than offsets[" +
                    std::to_string(i - 1) + "] = " + std::to_string(d.offsets[i - 1]) +
                    (d.offsets[i] == d.offsets[i - 1] ? " (sequence " + std::to_string(i - 1) + " is empty)"
                                                      : " (offsets must increase)"));
    if (d.offsets.back() != rows)
      throw Error(path + ": '/offsets' ends at " + std::to_string(d.offsets.back()) + " but '/observations' has " +
                  std::to_string(rows) + " rows");
    if (exists(d.file, "labels")) {
      d.labels = d.file.openDataSet("labels");
      const auto ld = dims_of(d.labels);
      if (d.labels.getTypeClass() != H5T_INTEGER || ld.size() != 1 || static_cast<int64_t>(ld[0]) != rows)
        throw Error(path + ": '/labels' must be a 1-d integer dataset with one entry per observation row (" +
                    std::to_string(rows) + ")");
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
  if (first < 0 || count < 1 || first + count > num_sequences())
    throw Error(d.path + ": sequences [" + std::to_string(first) + ", " + std::to_string(first + count) +
                ") are outside [0, " + std::to_string(num_sequences()) + ")");
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
      const at::Tensor ids = d.read_ids(d.observations, "observations", begin, n, d.symbols, "the vocabulary");
      b.observations = at::zeros({count * T}, at::kLong).index_copy_(0, target, ids).view({count, T});
    } else {
      const at::Tensor x = d.read_rows(d.observations, begin, n, d.float64 ? at::kDouble : at::kFloat, d.features);
      const at::Tensor bad = ~at::isfinite(x);
      if (bad.any().item<bool>()) {
        const at::Tensor i = bad.nonzero()[0];
        throw Error(d.where("observations", begin + i[0].item<int64_t>()) + "[" + std::to_string(i[1].item<int64_t>()) +
                    "] is " + (std::isnan(x[i[0]][i[1]].item<double>()) ? "NaN" : "infinite"));
      }
      b.observations = at::zeros({count * T, d.features}, x.options()).index_copy_(0, target, x).view({count, T, d.features});
    }
    if (with_labels) {
      const at::Tensor ids = d.read_ids(d.labels, "labels", begin, n, d.label_count, "the states");
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
  TemporaryH5 out;
  Appendable observations;
  std::unique_ptr<Appendable> labels;
  std::vector<int64_t> offsets{0};
  int64_t features;

  Impl(const std::string& path, int64_t f, bool with_labels)
      : out(path),
        observations(h5(path, [&] {
          return Appendable(out.file(), "observations", f ? H5::PredType::IEEE_F32LE : H5::PredType::STD_I32LE, f,
                            false);
        })),
        features(f) {
    if (with_labels)
      labels = h5(path, [&] { return std::make_unique<Appendable>(out.file(), "labels", H5::PredType::STD_I32LE, 0, false); });
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
  h5(w.out.path(), [&] {
    const at::Tensor rows = unpad(observations, l);
    w.observations.append(w.features ? rows.to(at::kFloat) : rows.to(at::kInt).squeeze(1));
    if (w.labels) w.labels->append(unpad(labels, l).to(at::kInt).squeeze(1));
  });
  for (int64_t i = 0; i < l.size(0); ++i) w.offsets.push_back(w.offsets.back() + l[i].item<int64_t>());
}

void HMMDatasetWriter::write_strings(const std::string& name, const std::vector<std::string>& values) {
  h5(impl_->out.path(), [&] { trellis::write_strings(impl_->out.file(), name, values); });
}

void HMMDatasetWriter::commit() {
  Impl& w = *impl_;
  h5(w.out.path(), [&] { write_int64s(w.out.file(), "offsets", w.offsets); });
  w.out.commit();
}

struct HMMInferenceWriter::Impl {
  TemporaryH5 out;
  Appendable log_likelihood, viterbi, states;
  std::unique_ptr<Appendable> posteriors, labels;
  at::Tensor state_labels;

  Impl(const std::string& path, const std::vector<int64_t>& offsets, int64_t k, bool with_posteriors,
       const std::vector<int64_t>& state_label_ids)
      : out(path),
        log_likelihood(h5(path, [&] { return Appendable(out.file(), "log_likelihood", H5::PredType::IEEE_F64LE, 0, false); })),
        viterbi(h5(path, [&] { return Appendable(out.file(), "viterbi_log_prob", H5::PredType::IEEE_F64LE, 0, false); })),
        states(h5(path, [&] { return Appendable(out.file(), "states", H5::PredType::STD_I32LE, 0, false); })) {
    h5(path, [&] {
      write_int64s(out.file(), "offsets", offsets);
      if (with_posteriors)
        posteriors = std::make_unique<Appendable>(out.file(), "posteriors", H5::PredType::IEEE_F32LE, k, true);
      if (!state_label_ids.empty()) {
        labels = std::make_unique<Appendable>(out.file(), "labels", H5::PredType::STD_I32LE, 0, false);
        state_labels = at::tensor(state_label_ids, at::kLong);
      }
    });
  }
};

HMMInferenceWriter::HMMInferenceWriter(const std::string& path, const std::vector<int64_t>& offsets, int64_t K,
                                       bool with_posteriors, const std::vector<int64_t>& state_labels)
    : impl_(std::make_unique<Impl>(path, offsets, K, with_posteriors, state_labels)) {}
HMMInferenceWriter::~HMMInferenceWriter() = default;

void HMMInferenceWriter::append(const at::Tensor& log_likelihood, const at::Tensor& viterbi_log_prob,
                                const at::Tensor& paths, const at::Tensor& lengths, const at::Tensor& posteriors) {
  Impl& w = *impl_;
  if ((w.posteriors != nullptr) != posteriors.defined())
    throw Error(w.out.path() + ": posteriors must be given with every batch, or never");
  h5(w.out.path(), [&] {
    w.log_likelihood.append(log_likelihood.detach().cpu().to(at::kDouble));
    w.viterbi.append(viterbi_log_prob.detach().cpu().to(at::kDouble));
    const at::Tensor path = unpad(paths, lengths).squeeze(1);
    w.states.append(path.to(at::kInt));
    if (w.labels) w.labels->append(w.state_labels.index_select(0, path).to(at::kInt));
    if (w.posteriors) w.posteriors->append(unpad(posteriors, lengths).to(at::kFloat));
  });
}

void HMMInferenceWriter::commit() { impl_->out.commit(); }

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
    if (!exists(f, "states") || !exists(f, "offsets")) throw Error(predictions + ": missing '/states' or '/offsets'");
    const H5::DataSet off = f.openDataSet("offsets"), states = f.openDataSet(exists(f, "labels") ? "labels" : "states");
    std::vector<int64_t> o(dims_of(off).at(0));
    off.read(o.data(), H5::PredType::NATIVE_INT64);
    if (o != data.offsets())
      throw Error(predictions + ": its '/offsets' differ from those of " + data.path() + " (predictions of other data?)");
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
