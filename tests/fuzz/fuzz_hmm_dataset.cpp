// trellis::HMMDataset on structure-aware HDF5 files (hdf5_builder.h): the input decodes into a valid HDF5 file whose
// offsets, observations (integer ids or float feature rows), labels and string datasets have arbitrary types, ranks,
// shapes and values; then the dataset is opened and every batch is read, with and without labels.
#include <ATen/ATen.h>

#include "fuzz_target.h"
#include "hdf5_builder.h"
#include "trellis/hmm/hmm_io.h"

namespace {

using trellis_fuzz::ElementType;
using trellis_fuzz::FuzzInput;
using trellis_fuzz::NaturalContents;

const std::vector<std::string> kWords = {"the", "cat", "sat", "on", "mat", "", "caf\xC3\xA9", "<unk>"};
const std::vector<std::string> kLabelNames = {"DET", "NOUN", "VERB|VBD", "ADP", "PUNCT"};

// Writes the dataset file at path.
void write_dataset(FuzzInput& in, const std::string& path) {
  trellis_fuzz::H5Builder file(path);
  if (!file.ok()) trellis_fuzz::finding("cannot create the scratch HDF5 file '" + path + "' (not a finding in the code under test)");

  // Sequence lengths 1..6 until the natural number of rows is reached.
  const hsize_t rows = 1 + in.below(48);
  std::vector<int64_t> offsets = {0};
  while (static_cast<hsize_t>(offsets.back()) < rows)
    offsets.push_back(std::min<int64_t>(offsets.back() + 1 + in.below(6), rows));

  const bool categorical = in.below(3) != 0;
  NaturalContents observations;
  if (categorical) {
    observations.type = in.flag() ? ElementType::int32 : ElementType::int64;
    observations.dims = {rows};
    observations.value = trellis_fuzz::small_id_value;
  } else {
    observations.type = in.flag() ? ElementType::float32 : ElementType::float64;
    observations.dims = {rows, 1 + in.below(4)};
    observations.value = trellis_fuzz::feature_value;
  }
  if (in.below(16) != 15) file.dataset(in, "observations", observations);

  NaturalContents offset_contents;
  offset_contents.type = ElementType::int64;
  offset_contents.dims = {offsets.size()};
  offset_contents.value = [&offsets](std::size_t i, const std::vector<hsize_t>&, FuzzInput&) {
    return static_cast<double>(i < offsets.size() ? offsets[i] : offsets.back() + static_cast<int64_t>(i));
  };
  if (in.below(16) != 15) file.dataset(in, "offsets", offset_contents);

  if (in.flag()) {
    NaturalContents labels;
    labels.type = ElementType::int32;
    labels.dims = {rows};
    labels.value = trellis_fuzz::small_id_value;
    file.dataset(in, "labels", labels);
  }
  for (const auto& [name, natural] : {std::pair{"vocabulary", &kWords}, std::pair{"label_names", &kLabelNames}}) {
    if (!in.flag()) continue;
    NaturalContents strings;
    strings.type = ElementType::variable_string;
    strings.dims = {natural->size()};
    strings.strings = *natural;
    file.dataset(in, name, strings);
  }
}

void read_everything(FuzzInput& in, const std::string& path) {
  const int64_t symbols = in.below(20), label_count = in.below(8), max_tokens = 1 + in.below(64);
  trellis::HMMDataset data(path);
  const int64_t N = data.num_sequences();
  const auto& offsets = data.offsets();
  if (N < 0 || offsets.empty() || offsets.front() != 0 || data.num_tokens() != offsets.back())
    trellis_fuzz::finding("HMMDataset accepted inconsistent offsets");
  if (symbols > 0) data.expect_symbols(symbols);
  if (label_count > 0) data.expect_labels(label_count);
  data.vocabulary();
  data.label_names();

  int64_t next = 0;
  for (const auto& [first, count] : data.batches(max_tokens)) {
    if (first != next || count < 1) trellis_fuzz::finding("HMMDataset::batches does not cover the sequences in order");
    next = first + count;
    int64_t longest = 0;
    for (int64_t i = first; i < first + count; ++i) longest = std::max(longest, offsets[i + 1] - offsets[i]);
    if (count > 1 && count * longest > max_tokens) trellis_fuzz::finding("a batch exceeds max_tokens");

    const trellis::SequenceBatch batch = data.read(first, count);
    if (batch.lengths.numel() != count || batch.observations.size(0) != count || batch.observations.size(1) != longest ||
        (data.categorical() ? batch.observations.dim() != 2
                            : batch.observations.dim() != 3 || batch.observations.size(2) != data.num_features()))
      trellis_fuzz::finding("HMMDataset::read returned a batch of the wrong shape");
    if (data.categorical() && symbols > 0 &&
        ((batch.observations < 0) | (batch.observations >= symbols)).any().item<bool>())
      trellis_fuzz::finding("HMMDataset::read returned ids outside expect_symbols");
    if (data.has_labels()) data.read(first, count, true);
  }
  if (next != N) trellis_fuzz::finding("HMMDataset::batches does not cover every sequence");
}

}  // namespace

TRELLIS_FUZZ_TARGET(hmm_dataset) {
  FuzzInput in(data, size);
  const std::string path = trellis_fuzz::scratch_path("hmm_dataset.h5");
  write_dataset(in, path);
  trellis_fuzz::succeeds_or_throws_error("HMMDataset", [&] { read_everything(in, path); });
}
