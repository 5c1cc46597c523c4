// Structure-aware input for the HDF5 readers: fuzz bytes decode into a *valid* HDF5 file (written with the HDF5 C
// API) whose contents are arbitrary — element types, ranks, shapes, values, attributes. Byte-level corruption of the
// container would only exercise libhdf5's own parser; this exercises what Trellis does with what libhdf5 returns.
//
// Every dataset and attribute is described by its *natural* form (what a well-formed file holds: type, shape,
// values) and one control byte from the input that keeps it or replaces its type, its shape or its values. An empty
// or exhausted input therefore decodes to the natural, well-formed file, so seeds stay small and mutations stay
// close to valid files.
#pragma once
#include <hdf5.h>

#include <functional>
#include <string>
#include <vector>

#include "fuzz_target.h"

namespace trellis_fuzz {

enum class ElementType {
  int8, uint8, int16, uint16, int32, uint32, int64, uint64, int32_big_endian,
  float32, float64, float64_big_endian,
  fixed_string, variable_string,
  compound, opaque, bitfield, enumeration, array,
};

struct NaturalContents {
  ElementType type = ElementType::float64;
  std::vector<hsize_t> dims;  // empty: a scalar
  // Value of element i (row-major) of an array of `dims`; may draw from the input. Unset: zeros.
  std::function<double(std::size_t i, const std::vector<hsize_t>& dims, FuzzInput& in)> value;
  std::vector<std::string> strings;  // for string types (cycled); empty: strings drawn from the input
};

// Natural values used by both HDF5 targets.
double probability_row_value(std::size_t i, const std::vector<hsize_t>& dims, FuzzInput& in);  // each row sums to 1
double small_id_value(std::size_t i, const std::vector<hsize_t>& dims, FuzzInput& in);         // 0..15
double feature_value(std::size_t i, const std::vector<hsize_t>& dims, FuzzInput& in);          // finite, varied
double positive_value(std::size_t i, const std::vector<hsize_t>& dims, FuzzInput& in);         // > 0

// A new HDF5 file at `path` (truncated), closed by the destructor. Creation failures of single objects (HDF5 refuses
// some shapes) leave the object out: the file is still valid.
class H5Builder {
 public:
  explicit H5Builder(const std::string& path);
  ~H5Builder();
  H5Builder(const H5Builder&) = delete;
  H5Builder& operator=(const H5Builder&) = delete;
  bool ok() const { return file_ >= 0; }
  void close();

  void dataset(FuzzInput& in, const char* name, const NaturalContents& natural);
  void attribute(FuzzInput& in, const char* name, const NaturalContents& natural);

 private:
  void object(FuzzInput& in, const char* name, const NaturalContents& natural, bool is_dataset);
  hid_t file_ = -1;
};

}  // namespace trellis_fuzz
