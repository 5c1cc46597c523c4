#!/usr/bin/env bash
# The trellis command line on good and bad input: every bad case exits non-zero with a message naming the file
# (and line where there is one) and writes nothing under the output's name; CRLF files and 10k-token sentences work.
# Usage: cli_test.sh TRELLIS_BINARY WORK_DIR
set -uo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/cli_harness.sh" || exit 1
trellis=$1
work=$2
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1

printf 'the DT B-NP\ncat NN I-NP\nsat VBD B-VP\n\na DT B-NP\ndog NN I-NP\n\n' >train.txt
printf 'Uw:%%x[0,0]\nUp:%%x[0,1]\nB\n' >good.tpl
"$trellis" crf train --train train.txt --model model.crf --max-iter 5 2>train.log || fail "training on good data"
[ -s model.crf ] && ok || fail "no model written"

printf 'the DT B-NP\ncat NN\n\n' >ragged.txt
expect_error "inconsistent columns" "ragged.txt:2: expected 3 columns, found 2" m1.crf \
  "$trellis" crf train --train ragged.txt --model m1.crf
: >empty.txt
expect_error "empty file" "empty.txt:1: empty file" m2.crf "$trellis" crf train --train empty.txt --model m2.crf
printf 'the DT B-NP\ncat NN B-XX\n\n' >unseen.txt
expect_error "unseen dev label" "unseen.txt:2: label 'B-XX'" m3.crf \
  "$trellis" crf train --train train.txt --dev unseen.txt --model m3.crf
printf 'U00:%%x[0]\n' >bad.tpl
expect_error "template syntax" "bad.tpl:1: malformed macro" m4.crf \
  "$trellis" crf train --train train.txt --model m4.crf --template bad.tpl
printf 'U00:%%x[0,0]\nU01:%%x[0,5]\n' >wide.tpl
expect_error "template column" "wide.tpl:2: column 5 is out of range" m5.crf \
  "$trellis" crf train --train train.txt --model m5.crf --template wide.tpl
printf '\xef\xbb\xbfU00:%%x[0,0]\n' >bom.tpl
"$trellis" crf train --train train.txt --model bom.crf --template bom.tpl --max-iter 2 2>/dev/null && ok ||
  fail "a template starting with a UTF-8 byte order mark"
printf 'U00:%%x[0,0]\nU01:\xff%%x[0,0]\n' >latin1.tpl
expect_error "template in Latin-1" "latin1.tpl:2: invalid UTF-8 byte at column 5" m5.crf \
  "$trellis" crf train --train train.txt --model m5.crf --template latin1.tpl
printf 'the DT B-NP\nc\000at NN I-NP\n\n' >nul.txt
expect_error "a NUL byte in a token" "nul.txt:2: NUL byte at column 2" m5.crf "$trellis" crf train --train nul.txt --model m5.crf
printf 'the DT B-NP\nc\xffat NN I-NP\n\n' >latin1.txt
expect_error "non-UTF-8" "latin1.txt:2: invalid UTF-8" m6.crf "$trellis" crf train --train latin1.txt --model m6.crf
expect_error "tag: wrong columns" "ragged.txt:2" out.txt "$trellis" crf tag --model model.crf ragged.txt -o out.txt
printf 'word POS label\n' >not-a-model.crf
expect_error "foreign model" "is not a Trellis CRF model" out2.txt \
  "$trellis" crf tag --model not-a-model.crf train.txt -o out2.txt
head -c 200 model.crf >truncated.crf
expect_error "truncated model" "corrupt model file" out3.txt "$trellis" crf tag --model truncated.crf train.txt -o out3.txt
expect_error "unknown option" "unrecognised option" m7.crf "$trellis" crf train --train train.txt --model m7.crf --bogus
expect_error "unknown device" "--device must be cpu, cuda or cuda:N, not 'gpu'" m7.crf \
  "$trellis" crf train --train train.txt --model m7.crf --device gpu
expect_error "unknown tagging device" "--device must be cpu, cuda or cuda:N, not 'mps'" out.txt \
  "$trellis" crf tag --model model.crf train.txt --device mps -o out.txt

# k-best: two alternatives per sentence, the first one the Viterbi labels.
"$trellis" crf tag --model model.crf train.txt --kbest 2 -o kbest.txt && [ "$(grep -c '^@kbest' kbest.txt)" = 4 ] &&
  ok || fail "k-best tagging"

# --timing reports tokens/s on stderr and leaves the output alone.
"$trellis" crf tag --model model.crf train.txt -o timed.txt --timing 2>timing.log && grep -q "tokens/s" timing.log &&
  "$trellis" crf tag --model model.crf train.txt -o untimed.txt && cmp -s timed.txt untimed.txt && ok || fail "tag --timing"
# CRLF input gives the same tags as LF input.
"$trellis" crf tag --model model.crf train.txt -o lf.txt && sed 's/$/\r/' train.txt >crlf.txt &&
  "$trellis" crf tag --model model.crf crlf.txt -o crlf.out && cmp -s lf.txt crlf.out && ok || fail "CRLF input"
# A 10,000-token sentence trains and tags.
awk 'BEGIN { for (i = 0; i < 10000; i++) print (i % 2 ? "cat NN I-NP" : "the DT B-NP"); print "" }' >long.txt
"$trellis" crf train --train long.txt --model long.crf --max-iter 3 2>/dev/null &&
  "$trellis" crf tag --model long.crf long.txt -o long.out && [ "$(grep -c . long.out)" = 10000 ] && ok ||
  fail "10k-token sentence"

# --c2 auto trains once per value of its grid, reports each one's dev score and keeps the model of the best one (the
# first of equals), whose score the summary repeats; without --dev it is an error. Few sentences of noisy labels (each
# word leans to one label, 60% are drawn at random): a small c2 fits the noise, a large one underfits, and the best
# value is neither the first nor the last.
awk 'BEGIN { srand(7); for (s = 0; s < 40; s++) { for (t = 0; t < 8; t++) { w = int(rand() * 150)
         l = rand() < 0.6 ? int(rand() * 4) : w % 4; print "w" w, "L" l } print "" } }' >auto-train.txt
awk 'BEGIN { srand(8); for (s = 0; s < 60; s++) { for (t = 0; t < 8; t++) { w = int(rand() * 150); print "w" w, "L" w % 4 }
         print "" } }' >auto-dev.txt
"$trellis" crf train --train auto-train.txt --dev auto-dev.txt --model auto.crf --c2 auto --max-iter 15 2>auto.log &&
  awk '/^c2 [0-9.]*: best dev acc / { n++; s[$2] = $6 + 0; if (n == 1 || $6 + 0 > best) { best = $6 + 0; at = $2 } }
       /^c2 auto: / { chosen = $3 ":" } /best dev \(iteration/ { final = $NF + 0 }
       END { distinct = 0; for (k in s) if (s[k] != best) distinct = 1
             exit !(n == 4 && distinct && chosen == at && final == best) }' auto.log && [ -s auto.crf ] && ok ||
  fail "--c2 auto: $(grep -v '^iter' auto.log)"
expect_error "--c2 auto without --dev" "--c2 auto chooses c2 by the dev score: it needs --dev" m8.crf \
  "$trellis" crf train --train train.txt --model m8.crf --c2 auto
expect_error "--c2 not a number" "--c2 (a number, or auto) 'often' is not a number" m9.crf \
  "$trellis" crf train --train train.txt --model m9.crf --c2 often

# Every command's --help exits 0 and prints its defaults as written (0.05, not 0.050000000000000003).
for cmd in "crf train" "crf train --encoder bilstm" "crf tag" "crf eval" "hmm init" "hmm sample" "hmm fit" \
  "hmm infer" "hmm eval" "bench"; do
  # shellcheck disable=SC2086  # the command's words
  if ! "$trellis" $cmd --help >help.txt 2>&1; then fail "$cmd --help: exit code"
  elif grep -E '\(=[-+]?[0-9]*\.?[0-9]{9,}' help.txt; then fail "$cmd --help: a default printed to full precision"
  else ok; fi
done

echo "cli: $passed passed, $failed failed"
[ "$failed" = 0 ]
