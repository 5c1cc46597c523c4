// Pieces every subcommand shares: option parsing with usage errors, number formatting, progress lines, and the
// tagged output and scores of `trellis crf tag` and `eval` (feature and neural taggers alike).
#pragma once
#include <boost/program_options.hpp>
#include <chrono>
#include <functional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "trellis/io/chunk_eval.h"
#include "trellis/io/conll.h"
#include "trellis/crf/crf_tagger.h"
#include "trellis/device.h"
#include "trellis/train/crf_train.h"

namespace trellis::cli {

// Parses args into vm. Returns -1 to go on, 0 after printing help, 2 on a usage error (message names `command`).
int parse(const std::string& command, const std::vector<std::string>& args,
          const boost::program_options::options_description& desc, boost::program_options::variables_map& vm,
          const std::string& usage, const boost::program_options::positional_options_description* positional = nullptr);

std::string fixed(double v, int digits);

// "512M", "2G", "1T" (binary units; m, g, t too), "100k" (1000s) or a plain byte count.
int64_t parse_bytes(const std::string& text);

// An option read as text that `parse` (a library parse_* function, whose Error names the option) turns into `target`
// once the command line is parsed; its default, if any, is given as text too.
template <class T, class Parse>
boost::program_options::typed_value<std::string>* parsed_value(T& target, Parse parse) {
  return boost::program_options::value<std::string>()->notifier(
      [&target, parse](const std::string& text) { target = parse(text); });
}
// --device: "cpu" by default, else cuda or cuda:N (parse_device) that this machine has (check_device_available).
boost::program_options::typed_value<std::string>* device_value(c10::Device& device);

// --threads: CPU threads, 0 (the default) for LibTorch's default, at most as many as the machine runs at once (more
// only add threads that wait).
boost::program_options::typed_value<std::string>* threads_value(int& threads);
// --seed: a non-negative integer (a negative one is an error, not a seed wrapped around 2^64), 0 by default.
boost::program_options::typed_value<std::string>* seed_value(uint64_t& seed);

// "1,2" or "-1": a comma-separated list of integers; `option` names the option in the error.
std::vector<int> parse_int_list(const std::string& text, const std::string& option);

// A floating-point number, the whole of `text` (nan and inf too: the option's own check rejects them by name);
// `option` names the option in the error.
double parse_number(const std::string& text, const std::string& option);

// Throws an Error when `output` (the file option `option` names) is one of `inputs` ({option, path}; empty paths and
// "-" skipped), through links and other names alike: a command never replaces a file it reads. Devices and pipes
// (/dev/null) may be both.
void check_output_is_not_an_input(const std::string& option, const std::string& output,
                                  const std::vector<std::pair<std::string, std::string>>& inputs);

// A CoNLL file, or standard input for "-".
ConllCorpus read_input(const std::string& path);
// Throws an Error when more than one of `inputs` ({option, path}) is "-": standard input can be read once.
void check_standard_input_read_once(const std::vector<std::pair<std::string, std::string>>& inputs);
// A file's input columns as a model reads them (the file projected onto the model's layout, with or without its
// label): each row cut to the model's `input_columns`.
std::vector<TokenRows> model_inputs(const ConllCorpus& projected, std::size_t input_columns);
std::vector<const TokenRows*> pointers(const std::vector<TokenRows>& sentences);
// Calls `write` on standard output for "-", otherwise on a file written atomically.
void write_output(const std::string& path, const std::function<void(std::ostream&)>& write);

// The options of `crf tag`, for feature and neural models alike.
struct TagArguments {
  std::string model_path, input, output;
  c10::Device device = c10::kCPU;
  bool with_marginals = false, with_probability = false, timing = false;
  int64_t kbest = 0;
};
// Their descriptions, filled into `a` by parse_tag_arguments; a caller may add options of its own.
boost::program_options::options_description tag_options(TagArguments& a);
// Parses args (as parse()) and checks them: --kbest >= 0, not with --marginals, an output location that can be
// written. Returns -1 to go on, or the exit code.
int parse_tag_arguments(const std::vector<std::string>& args, const boost::program_options::options_description& desc,
                        TagArguments& a);

// `crf dump [--model] FILE [--top N]` (`top_description` says what --top lists): as parse(), -1 to go on.
int parse_dump_arguments(const std::vector<std::string>& args, const std::string& top_description,
                         const std::string& usage, std::string& model_path, int& top);

// `crf tag` output: each token's columns and its label (with ":P", its marginal, when with_marginals), a blank line
// after each sentence, and with_probability an "@probability P" line before it.
void write_tagged(const std::string& output, const ConllCorpus& corpus, const std::vector<TaggedSentence>& tagged,
                  bool with_marginals, bool with_probability);
// `crf tag --kbest` output: each alternative after an "@kbest RANK P" line.
void write_kbest(const std::string& output, const ConllCorpus& corpus,
                 const std::vector<std::vector<TaggedSentence>>& alternatives);

// Tags `rows` (the corpus's sentences as the model reads them) with a CrfTagger or a NeuralTagger and writes what
// --kbest, --marginals and --probability ask for.
template <class Tagger>
void tag_and_write(const Tagger& model, const TagArguments& a, const ConllCorpus& corpus,
                   const std::vector<TokenRows>& rows) {
  if (a.kbest > 0) write_kbest(a.output, corpus, model.tag_kbest(pointers(rows), a.kbest));
  else
    write_tagged(a.output, corpus, model.tag(pointers(rows), a.with_marginals || a.with_probability), a.with_marginals,
                 a.with_probability);
}

// `crf eval --gold`: the gold file in the model's layout, split into inputs and labels; a file without the label
// column is an Error naming it and the layout.
LabeledSentences gold_sentences(const ColumnLayout& layout, const std::string& path);
// Scores tagged sentences against gold ones. Gold labels the model never saw (I-LST in the CoNLL-2000 test set, say)
// cannot be predicted: they count as errors, as in conlleval, and a note on stderr lists them.
ChunkEvaluation score_tagged(const LabeledSentences& gold, const std::vector<TaggedSentence>& tagged,
                             const std::function<bool(const std::string&)>& known_label);
// Token accuracy, and for chunk labels conlleval's report, on stdout.
void print_evaluation(const ChunkEvaluation& evaluation);

// Prints "label: done/total unit, rate/s" to stderr at most once per interval, and once at the end.
class Progress {
 public:
  Progress(std::string label, int64_t total, std::string unit, double interval_seconds = 2.0);
  void update(int64_t done);  // the total done so far
  void finish();
  double seconds() const;

 private:
  void print();
  std::string label_, unit_;
  int64_t total_, done_ = 0;
  double interval_;
  std::chrono::steady_clock::time_point start_, last_;
};

}  // namespace trellis::cli
