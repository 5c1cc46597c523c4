#include "cli_util.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>
#include <thread>

#include <sys/stat.h>

#include "trellis/io/atomic_file.h"
#include "trellis/error.h"

namespace po = boost::program_options;

namespace trellis::cli {

int parse(const std::string& command, const std::vector<std::string>& args, const po::options_description& desc,
          po::variables_map& vm, const std::string& usage, const po::positional_options_description* positional) {
  try {
    po::command_line_parser parser(args);
    parser.options(desc);
    // No positional arguments unless the command names some: a stray word is an error, not silently dropped.
    const po::positional_options_description none;
    parser.positional(positional ? *positional : none);
    po::store(parser.run(), vm);
    if (vm.count("help")) {
      std::cout << usage << "\n" << desc;
      return 0;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    std::cerr << "trellis " << command << ": " << e.what() << "\n" << usage << "\n" << desc;
    return 2;
  }
  return -1;
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

namespace {

// The number at the start of `text`; *used gets how many characters it took (0: none).
double leading_number(const std::string& text, std::size_t* used) {
  try {
    return std::stod(text, used);
  } catch (const std::exception&) {
    *used = 0;
    return 0;
  }
}

}  // namespace

int64_t parse_bytes(const std::string& text) {
  std::size_t used = 0;
  const double v = leading_number(text, &used);
  const std::string unit = text.substr(used);
  const double scale = unit.empty()                 ? 1
                       : unit == "k" || unit == "K" ? 1e3
                       : unit == "m" || unit == "M" ? 0x1p20
                       : unit == "g" || unit == "G" ? 0x1p30
                       : unit == "t" || unit == "T" ? 0x1p40
                                                    : -1;
  if (used == 0 || scale < 0 || !(v > 0) || !std::isfinite(v))
    throw Error("'" + text + "' is not a size (examples: 512M, 2G, 1T, 100000)");
  if (v * scale >= 9.2e18) throw Error("'" + text + "' is larger than any memory");
  return static_cast<int64_t>(v * scale);
}

std::vector<int> parse_int_list(const std::string& text, const std::string& option) {
  std::vector<int> values;
  std::size_t begin = 0;
  while (true) {
    const std::size_t end = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, end - begin);
    std::size_t used = 0;
    try {
      values.push_back(std::stoi(item, &used));
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size())
      throw Error(option + " '" + text + "' is not a comma-separated list of integers (examples: -1, 1,2)");
    if (end == text.size()) return values;
    begin = end + 1;
  }
}

po::typed_value<std::string>* device_value(c10::Device& device) {
  return parsed_value(device, [](const std::string& text) {
           const c10::Device d = parse_device(text);
           check_device_available(d);
           return d;
         })
      ->default_value("cpu");
}

namespace {

// The whole of `text` as an integer in [low, high], else an Error naming `option` and what it takes.
int64_t parse_integer(const std::string& text, const std::string& option, int64_t low, int64_t high,
                      const std::string& takes) {
  std::size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || value < low || value > high)
    throw Error(option + " '" + text + "': " + takes);
  return value;
}

}  // namespace

po::typed_value<std::string>* threads_value(int& threads) {
  return parsed_value(threads, [](const std::string& text) {
           const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
           return static_cast<int>(parse_integer(
               text, "--threads", 0, cores,
               "takes 0 (all) to " + std::to_string(cores) + ", the threads this machine runs at once"));
         })
      ->default_value("0");
}

po::typed_value<std::string>* seed_value(uint64_t& seed) {
  return parsed_value(seed, [](const std::string& text) {
           return static_cast<uint64_t>(
               parse_integer(text, "--seed", 0, std::numeric_limits<int64_t>::max(), "takes an integer >= 0"));
         })
      ->default_value("0");
}

double parse_number(const std::string& text, const std::string& option) {
  std::size_t used = 0;
  const double value = leading_number(text, &used);
  if (used == 0 || used != text.size()) throw Error(option + " '" + text + "' is not a number");
  return value;
}

void check_output_is_not_an_input(const std::string& option, const std::string& output,
                                  const std::vector<std::pair<std::string, std::string>>& inputs) {
  struct stat out {};
  if (output.empty() || output == "-" || ::stat(output.c_str(), &out) != 0 || !S_ISREG(out.st_mode)) return;
  for (const auto& [input_option, path] : inputs) {
    struct stat in {};
    if (path.empty() || path == "-" || ::stat(path.c_str(), &in) != 0) continue;
    if (in.st_dev == out.st_dev && in.st_ino == out.st_ino)
      throw Error(option + " '" + output + "' is the " + input_option + " file" +
                  (path == output ? "" : " ('" + path + "')") + ": writing it would destroy what the command reads");
  }
}

ConllCorpus read_input(const std::string& path) {
  return path == "-" ? read_conll(std::cin, "<stdin>") : read_conll(path);
}

void check_standard_input_read_once(const std::vector<std::pair<std::string, std::string>>& inputs) {
  const std::string* first = nullptr;
  for (const auto& [option, path] : inputs) {
    if (path != "-") continue;
    if (first) throw Error(*first + " and " + option + " are both '-': standard input can be read only once");
    first = &option;
  }
}

std::vector<TokenRows> model_inputs(const ConllCorpus& projected, std::size_t input_columns) {
  std::vector<TokenRows> rows;
  rows.reserve(projected.sentences.size());
  for (const ConllSentence& s : projected.sentences) {
    TokenRows r = s.rows;
    for (auto& row : r) row.resize(input_columns);
    rows.push_back(std::move(r));
  }
  return rows;
}

std::vector<const TokenRows*> pointers(const std::vector<TokenRows>& sentences) {
  std::vector<const TokenRows*> p;
  for (const auto& r : sentences) p.push_back(&r);
  return p;
}

void write_output(const std::string& path, const std::function<void(std::ostream&)>& write) {
  if (path == "-") {
    errno = 0;
    write(std::cout);
    if (!std::cout.flush() || std::fflush(stdout) != 0) {
      const std::string cause = errno ? std::strerror(errno) : "a write failed";
      std::cout.clear();  // reported here: main's own check of standard output finds nothing left to report
      std::clearerr(stdout);
      throw Error("cannot write standard output: " + cause);
    }
  } else {
    write_file_atomically(path, write);
  }
}

po::options_description tag_options(TagArguments& a) {
  po::options_description desc("options");
  desc.add_options()("help,h", "this message")("model,m", po::value(&a.model_path)->required(), "trained model")(
      "input,i", po::value(&a.input)->default_value("-"),
      "CoNLL input (- for stdin); a trailing label column is ignored")(
      "output,o", po::value(&a.output)->default_value("-"), "output file (- for stdout), written atomically")(
      "marginals", po::bool_switch(&a.with_marginals), "append ':P' (the predicted label's marginal) to each label")(
      "probability", po::bool_switch(&a.with_probability), "print '@probability P' before each sentence")(
      "kbest,n", po::value(&a.kbest)->default_value(0),
      "the N most probable label sequences of each sentence, each after a line '@kbest RANK PROBABILITY'")(
      "device", device_value(a.device), "cpu, cuda or cuda:N")("timing", po::bool_switch(&a.timing),
                                                               "print load and tagging times and tokens/s to stderr");
  return desc;
}

int parse_tag_arguments(const std::vector<std::string>& args, const po::options_description& desc, TagArguments& a) {
  po::positional_options_description pos;
  pos.add("input", 1);
  po::variables_map vm;
  if (int rc = parse("crf", args, desc, vm, "usage: trellis crf tag --model FILE [INPUT] [options]", &pos); rc >= 0)
    return rc;
  if (a.kbest < 0) throw Error("--kbest must be >= 0 (0: off), not " + std::to_string(a.kbest));
  if (a.kbest > 0 && a.with_marginals) throw Error("--kbest and --marginals cannot be combined");
  if (a.kbest > 0 && a.with_probability)
    throw Error("--kbest and --probability cannot be combined (--kbest prints each sequence's probability)");
  if (a.output != "-") check_writable_location(a.output);
  check_output_is_not_an_input("--output", a.output, {{"--model", a.model_path}, {"input", a.input}});
  return -1;
}

int parse_dump_arguments(const std::vector<std::string>& args, const std::string& top_description,
                         const std::string& usage, std::string& model_path, int& top) {
  po::options_description desc("options");
  desc.add_options()("help,h", "this message")("model,m", po::value(&model_path)->required(), "model file")(
      "top", po::value(&top)->default_value(20), top_description.c_str());
  po::positional_options_description pos;
  pos.add("model", 1);
  po::variables_map vm;
  const int rc = parse("crf", args, desc, vm, usage, &pos);
  if (rc < 0 && top < 0) throw Error("--top must be >= 0, not " + std::to_string(top));
  return rc;
}

void write_tagged(const std::string& output, const ConllCorpus& corpus, const std::vector<TaggedSentence>& tagged,
                  bool with_marginals, bool with_probability) {
  write_output(output, [&](std::ostream& out) {
    for (std::size_t s = 0; s < tagged.size(); ++s) {
      if (with_probability) out << "@probability\t" << fixed(tagged[s].probability, 6) << "\n";
      for (std::size_t t = 0; t < tagged[s].labels.size(); ++t) {
        for (const auto& col : corpus.sentences[s].rows[t]) out << col << '\t';
        out << tagged[s].labels[t];
        if (with_marginals) out << ':' << fixed(tagged[s].marginals[t], 6);
        out << '\n';
      }
      out << '\n';
    }
  });
}

void write_kbest(const std::string& output, const ConllCorpus& corpus,
                 const std::vector<std::vector<TaggedSentence>>& alternatives) {
  write_output(output, [&](std::ostream& out) {
    for (std::size_t s = 0; s < alternatives.size(); ++s)
      for (std::size_t n = 0; n < alternatives[s].size(); ++n) {
        out << "@kbest\t" << n << '\t' << fixed(alternatives[s][n].probability, 6) << '\n';
        for (std::size_t t = 0; t < alternatives[s][n].labels.size(); ++t) {
          for (const auto& col : corpus.sentences[s].rows[t]) out << col << '\t';
          out << alternatives[s][n].labels[t] << '\n';
        }
        out << '\n';
      }
  });
}

LabeledSentences gold_sentences(const ColumnLayout& layout, const std::string& path) {
  bool has_labels = false;
  const ConllCorpus c = layout.project(read_input(path), &has_labels);
  if (!has_labels)
    throw Error("'" + c.source +
                "' has no label column to evaluate against (the model's columns: " + layout.describe() + ")");
  return split_labels(c, -1);
}

ChunkEvaluation score_tagged(const LabeledSentences& gold, const std::vector<TaggedSentence>& tagged,
                             const std::function<bool(const std::string&)>& known_label) {
  ChunkEvaluation ev;
  std::map<std::string, std::size_t> unseen;
  for (std::size_t s = 0; s < tagged.size(); ++s) {
    for (const auto& label : gold.labels[s])
      if (!known_label(label)) ++unseen[label];
    ev.add_sentence(gold.labels[s], tagged[s].labels);
  }
  if (!unseen.empty()) {
    std::size_t tokens = 0;
    std::string list;
    for (const auto& [label, n] : unseen)
      tokens += n, list += (list.empty() ? "" : ", ") + label + " (" + std::to_string(n) + ")";
    std::cerr << "note: " << tokens
              << " gold tokens have labels the model was not trained on, counted as errors: " << list << "\n";
  }
  return ev;
}

void print_evaluation(const ChunkEvaluation& ev) {
  std::cout << "token accuracy: " << fixed(ev.accuracy(), 2) << "% (" << ev.correct_tokens << "/" << ev.tokens << ")\n";
  if (ev.overall.gold + ev.overall.guessed > 0) std::cout << ev.report();  // chunk labels: conlleval's report
}

Progress::Progress(std::string label, int64_t total, std::string unit, double interval)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total), interval_(interval),
      start_(std::chrono::steady_clock::now()), last_(start_) {}

double Progress::seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void Progress::update(int64_t done) {
  done_ = done;
  const auto now = std::chrono::steady_clock::now();
  if (std::chrono::duration<double>(now - last_).count() >= interval_) {
    last_ = now;
    print();
  }
}

void Progress::finish() { print(); }

// One write per line: the ranks of a torchrun job share the terminal, and pieces of their lines would interleave.
void Progress::print() {
  const double s = seconds();
  const std::string line = label_ + ": " + std::to_string(done_) + "/" + std::to_string(total_) + " " + unit_ + " (" +
                           fixed(100.0 * done_ / std::max<int64_t>(total_, 1), 1) + "%), " + fixed(s, 1) + " s, " +
                           fixed(s > 0 ? done_ / s : 0, 0) + " " + unit_ + "/s\n";
  std::cerr << line << std::flush;
}

}  // namespace trellis::cli
