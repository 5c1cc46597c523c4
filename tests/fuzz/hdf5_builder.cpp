#include "hdf5_builder.h"

#include <cmath>
#include <limits>

namespace trellis_fuzz {
namespace {

// Larger arrays are created but never written: HDF5 allocates their storage late and reads them back as fill values,
// so a small file can claim a huge shape (which is exactly what a reader must not trust blindly).
constexpr std::size_t kMaxWrittenBytes = std::size_t(1) << 20;
constexpr std::size_t kMaxAttributeBytes = std::size_t(1) << 16;

constexpr ElementType kAllTypes[] = {
    ElementType::int8,         ElementType::uint8,           ElementType::int16,     ElementType::uint16,
    ElementType::int32,        ElementType::uint32,          ElementType::int64,     ElementType::uint64,
    ElementType::int32_big_endian, ElementType::float32,     ElementType::float64,   ElementType::float64_big_endian,
    ElementType::fixed_string, ElementType::variable_string, ElementType::compound,  ElementType::opaque,
    ElementType::bitfield,     ElementType::enumeration,     ElementType::array,
};

constexpr hsize_t kLargeDims[] = {64, 1000, 65535, 65536, hsize_t(1) << 20, hsize_t(1) << 24, hsize_t(1) << 31,
                                  hsize_t(1) << 32, hsize_t(1) << 40, hsize_t(1) << 60, (~hsize_t(0)) >> 1};

constexpr double kSpecialValues[] = {0.0,     -0.0,    1.0,     -1.0,     0.5,     2.0,      255.0,   256.0,
                                     65536.0, 2147483648.0, -2147483648.0, 9007199254740992.0, 9.2233720368547758e18,
                                     -9.2233720368547758e18, 1.8446744073709552e19, 1e300, -1e300,
                                     std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                                     std::numeric_limits<double>::quiet_NaN(), 1e-310, 1e-6, 1.0 + 1e-7, 1.0 - 1e-7};

enum class TypeClass { number, string, other };

TypeClass class_of(ElementType t) {
  switch (t) {
    case ElementType::fixed_string:
    case ElementType::variable_string: return TypeClass::string;
    case ElementType::compound:
    case ElementType::opaque:
    case ElementType::bitfield:
    case ElementType::enumeration:
    case ElementType::array: return TypeClass::other;
    default: return TypeClass::number;
  }
}

// The file type of t (a new handle; the caller closes it). A string type the input chose draws its details (size,
// padding, character set) from the input too; a natural string type is UTF-8 and NUL-terminated.
hid_t file_type(ElementType t, bool natural, FuzzInput& in) {
  switch (t) {
    case ElementType::int8: return H5Tcopy(H5T_STD_I8LE);
    case ElementType::uint8: return H5Tcopy(H5T_STD_U8LE);
    case ElementType::int16: return H5Tcopy(H5T_STD_I16LE);
    case ElementType::uint16: return H5Tcopy(H5T_STD_U16LE);
    case ElementType::int32: return H5Tcopy(H5T_STD_I32LE);
    case ElementType::uint32: return H5Tcopy(H5T_STD_U32LE);
    case ElementType::int64: return H5Tcopy(H5T_STD_I64LE);
    case ElementType::uint64: return H5Tcopy(H5T_STD_U64LE);
    case ElementType::int32_big_endian: return H5Tcopy(H5T_STD_I32BE);
    case ElementType::float32: return H5Tcopy(H5T_IEEE_F32LE);
    case ElementType::float64: return H5Tcopy(H5T_IEEE_F64LE);
    case ElementType::float64_big_endian: return H5Tcopy(H5T_IEEE_F64BE);
    case ElementType::fixed_string:
    case ElementType::variable_string: {
      const hid_t s = H5Tcopy(H5T_C_S1);
      const H5T_str_t pads[] = {H5T_STR_NULLTERM, H5T_STR_NULLPAD, H5T_STR_SPACEPAD};
      if (t == ElementType::variable_string) {
        H5Tset_size(s, H5T_VARIABLE);
      } else {
        H5Tset_size(s, natural ? 8 : 1 + in.below(16));
        H5Tset_strpad(s, natural ? H5T_STR_NULLTERM : in.pick(pads));
      }
      H5Tset_cset(s, natural || in.flag() ? H5T_CSET_UTF8 : H5T_CSET_ASCII);
      return s;
    }
    case ElementType::compound: {
      const hid_t c = H5Tcreate(H5T_COMPOUND, 12);
      H5Tinsert(c, "id", 0, H5T_STD_I32LE);
      H5Tinsert(c, "value", 4, H5T_IEEE_F64LE);
      return c;
    }
    case ElementType::opaque: {
      const hid_t o = H5Tcreate(H5T_OPAQUE, 1 + in.below(8));
      H5Tset_tag(o, "fuzz");
      return o;
    }
    case ElementType::bitfield: return H5Tcopy(H5T_STD_B16LE);
    case ElementType::enumeration: {
      const hid_t e = H5Tenum_create(H5T_STD_I32LE);
      const int32_t zero = 0, one = 1;
      H5Tenum_insert(e, "A", &zero);
      H5Tenum_insert(e, "B", &one);
      return e;
    }
    case ElementType::array: {
      const hsize_t length = 2 + in.below(3);
      return H5Tarray_create2(H5T_STD_I64LE, 1, &length);
    }
  }
  return -1;
}

hsize_t fuzz_dim(FuzzInput& in) {
  const uint8_t b = in.byte();
  return b < 224 ? b % 17 : kLargeDims[b % (sizeof kLargeDims / sizeof kLargeDims[0])];
}

// Number of elements, saturating (a shape whose product overflows is never written anyway).
std::size_t element_count(const std::vector<hsize_t>& dims) {
  std::size_t n = 1;
  for (hsize_t d : dims) {
    if (d != 0 && n > std::numeric_limits<std::size_t>::max() / d) return std::numeric_limits<std::size_t>::max();
    n *= d;
  }
  return n;
}

// Closes an HDF5 handle with the matching function when it goes out of scope.
struct Handle {
  hid_t id;
  herr_t (*close)(hid_t);
  ~Handle() {
    if (id >= 0) close(id);
  }
};

}  // namespace

double probability_row_value(std::size_t, const std::vector<hsize_t>& dims, FuzzInput&) {
  const hsize_t row = dims.empty() ? 1 : dims.back();
  return row ? 1.0 / static_cast<double>(row) : 1.0;
}
double small_id_value(std::size_t, const std::vector<hsize_t>&, FuzzInput& in) { return in.byte() % 16; }
double feature_value(std::size_t, const std::vector<hsize_t>&, FuzzInput& in) {
  return static_cast<int8_t>(in.byte()) / 4.0;
}
double positive_value(std::size_t, const std::vector<hsize_t>&, FuzzInput& in) { return 0.25 + in.byte() / 16.0; }

H5Builder::H5Builder(const std::string& path) {
  file_ = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
}

H5Builder::~H5Builder() { close(); }

void H5Builder::close() {
  if (file_ >= 0) H5Fclose(file_);
  file_ = -1;
}

void H5Builder::dataset(FuzzInput& in, const char* name, const NaturalContents& natural) {
  object(in, name, natural, true);
}

void H5Builder::attribute(FuzzInput& in, const char* name, const NaturalContents& natural) {
  object(in, name, natural, false);
}

// Control byte: bits 0-1 type (3: any type), bits 2-3 shape (2: one dimension changed, 3: any shape), bits 4-6 values
// (4: zeros, 5: raw bytes, 6: special values, 7: small integers), bit 7 chunked layout. Zero keeps the natural form.
void H5Builder::object(FuzzInput& in, const char* name, const NaturalContents& natural, bool is_dataset) {
  if (file_ < 0) return;
  const uint8_t control = in.byte();
  const bool natural_type = (control & 3) != 3;
  const ElementType type = natural_type ? natural.type : in.pick(kAllTypes);
  const int shape_mode = (control >> 2) & 3, values_mode = (control >> 4) & 7;
  const bool chunked = control & 0x80;

  std::vector<hsize_t> dims = natural.dims;
  bool null_space = false;
  if (shape_mode == 2 && !dims.empty()) {
    hsize_t& d = dims[in.below(dims.size())];
    switch (in.below(4)) {
      case 0: d += 1; break;
      case 1: d = d ? d - 1 : 1; break;
      case 2: d *= 2; break;
      default: d = 0; break;
    }
  } else if (shape_mode == 3) {
    const std::size_t rank = in.below(5);
    null_space = rank == 4;
    dims.assign(null_space ? 0 : rank, 0);
    for (hsize_t& d : dims) d = fuzz_dim(in);
  }

  const Handle ftype{file_type(type, natural_type, in), H5Tclose};
  if (ftype.id < 0) return;
  const Handle space{null_space     ? H5Screate(H5S_NULL)
                     : dims.empty() ? H5Screate(H5S_SCALAR)
                                    : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                     H5Sclose};
  if (space.id < 0) return;
  const std::size_t n = null_space ? 0 : element_count(dims);
  const std::size_t type_size = H5Tget_size(ftype.id);
  // An attribute lives in its object header (at most 64 KiB). libhdf5 1.10 creates larger ones without complaint and
  // then corrupts memory flushing them when the file closes: a bug of the writer, not of what Trellis reads.
  if (!is_dataset && (type_size == 0 || n > kMaxAttributeBytes / type_size)) return;
  Handle object{-1, is_dataset ? H5Dclose : H5Aclose};
  if (is_dataset) {
    const Handle dcpl{H5Pcreate(H5P_DATASET_CREATE), H5Pclose};
    bool all_positive = !dims.empty();
    for (hsize_t d : dims) all_positive = all_positive && d > 0;
    if (chunked && all_positive) {
      std::vector<hsize_t> chunk(dims);
      for (hsize_t& c : chunk) c = std::min<hsize_t>(c, 4);
      H5Pset_chunk(dcpl.id, static_cast<int>(chunk.size()), chunk.data());
    }
    object.id = H5Dcreate2(file_, name, ftype.id, space.id, H5P_DEFAULT, dcpl.id, H5P_DEFAULT);
  } else {
    object.id = H5Acreate2(file_, name, ftype.id, space.id, H5P_DEFAULT, H5P_DEFAULT);
  }
  if (object.id < 0) return;

  if (n == 0 || type_size == 0 || n > kMaxWrittenBytes / type_size) return;
  const auto write = [&](hid_t memory_type, const void* buffer) {
    if (is_dataset)
      H5Dwrite(object.id, memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, buffer);
    else
      H5Awrite(object.id, memory_type, buffer);
  };

  const TypeClass cls = class_of(type);
  const bool raw = values_mode == 5 || cls == TypeClass::other;
  if (cls == TypeClass::string && (type == ElementType::variable_string || !raw)) {
    std::vector<std::string> strings(n);
    for (std::size_t i = 0; i < n; ++i)
      strings[i] = values_mode < 4 && !natural.strings.empty() ? natural.strings[i % natural.strings.size()]
                                                               : in.bytes(12);
    if (type == ElementType::variable_string) {
      std::vector<const char*> pointers(n);
      for (std::size_t i = 0; i < n; ++i) pointers[i] = strings[i].c_str();
      write(ftype.id, pointers.data());
    } else {
      std::vector<char> buffer(n * type_size, '\0');
      for (std::size_t i = 0; i < n; ++i) strings[i].copy(&buffer[i * type_size], type_size);
      write(ftype.id, buffer.data());
    }
  } else if (raw) {
    std::vector<uint8_t> buffer(n * type_size);
    for (uint8_t& b : buffer) b = in.byte();
    write(ftype.id, buffer.data());
  } else {
    std::vector<double> values(n);
    for (std::size_t i = 0; i < n; ++i) {
      switch (values_mode) {
        case 4: values[i] = 0; break;
        case 6: values[i] = in.pick(kSpecialValues); break;
        case 7: values[i] = static_cast<int8_t>(in.byte()); break;
        default: values[i] = natural.value ? natural.value(i, dims, in) : 0; break;
      }
    }
    write(H5T_NATIVE_DOUBLE, values.data());
  }
}

}  // namespace trellis_fuzz
