#include <gtest/gtest.h>

#include "trellis/crf/crf_features.h"
#include "trellis/error.h"

using namespace trellis;

namespace {

std::vector<std::string> features(const FeatureExtractor& fx, const TokenRows& rows, std::size_t t) {
  FeatureList out;
  fx.extract(rows, t, out);
  return out.strings();
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(CrfppTemplate, ExpandsMacrosWithCrfppBoundaryNames) {
  const auto fx =
      crfpp_template_features("# unigrams\nU00:%x[-1,0]\n\nU01:%x[0,1]/%x[1,0]\r\nU02:%x[-2,0]%x[2,1]\nB\n");
  const TokenRows rows{{"a", "X"}, {"b", "Y"}};
  EXPECT_EQ(features(*fx, rows, 0), (std::vector<std::string>{"U00:_B-1", "U01:X/b", "U02:_B-2_B+1"}));
  EXPECT_EQ(features(*fx, rows, 1), (std::vector<std::string>{"U00:a", "U01:Y/_B+1", "U02:_B-1_B+2"}));
  EXPECT_NO_THROW(fx->validate(2, "data"));
  const std::string e = error_of([&] { fx->validate(1, "data.txt"); });
  EXPECT_NE(e.find(":4: column 1 is out of range"), std::string::npos) << e;
  EXPECT_NE(e.find("data.txt"), std::string::npos) << e;
}

TEST(CrfppTemplate, SyntaxErrorsNameTheLine) {
  EXPECT_NE(error_of([] { crfpp_template_features("U00:%x[0,0]\nQ01:x\n", "t.tpl"); }).find("t.tpl:2:"),
            std::string::npos);
  EXPECT_NE(error_of([] { crfpp_template_features("\nU00:%x[0]\n", "t.tpl"); }).find("t.tpl:2: malformed macro"),
            std::string::npos);
  EXPECT_NE(error_of([] { crfpp_template_features("U00:%x[a,0]\n", "t.tpl"); }).find("t.tpl:1:"), std::string::npos);
  EXPECT_NE(error_of([] { crfpp_template_features("U00:%x[0,0]\nB01:%x[0,0]\n", "t.tpl"); }).find("t.tpl:2: bigram"),
            std::string::npos);
  EXPECT_NE(error_of([] { crfpp_template_features("# nothing\nB\n", "t.tpl"); }).find("no unigram"), std::string::npos);
  EXPECT_NE(error_of([] { load_crfpp_template("/nonexistent/template"); }).find("cannot open template"),
            std::string::npos);
}

TEST(CrfppTemplate, SpecRecreatesTheExtractor) {
  const auto fx = crfpp_template_features("U00:%x[0,0]\nU01:%x[1,0]\n");
  const auto again = FeatureExtractor::from_spec(fx->spec());
  const TokenRows rows{{"x"}, {"y"}};
  EXPECT_EQ(features(*again, rows, 0), features(*fx, rows, 0));
  EXPECT_THROW(FeatureExtractor::from_spec("something else"), Error);
}

TEST(BuiltinFeatures, CoverWordShapeAffixesWindowAndExtraColumns) {
  const auto fx = builtin_features();
  const TokenRows rows{{"The", "DT"}, {"Über-cat", "NN"}, {"42", "CD"}};
  const auto f = features(*fx, rows, 1);
  for (const char* want : {"b", "w=Über-cat", "p1=Ü", "s2=at", "shape=ux-x", "hyphen", "w[-1]=the", "w[1]=42",
                           "w[2]=</s>", "c1[0]=NN", "c1[-1|0]=DT|NN"})
    EXPECT_NE(std::find(f.begin(), f.end(), want), f.end()) << want;
  const auto g = features(*fx, rows, 2);
  EXPECT_NE(std::find(g.begin(), g.end(), "alldigit"), g.end());
}
