#!/usr/bin/env python3
"""Doxygen INPUT_FILTER for Trellis' headers (docs/Doxyfile): reads a header, prints it with its comments as Doxygen's.

The headers document every declaration with plain `//` comments (the project's style), which Doxygen ignores. This
turns them into Doxygen comments, line for line (warnings keep their line numbers):
- the comment block that opens the file documents the file (`/// ... @file`);
- a comment on lines of its own documents the declaration after it (`///`);
- a comment after code documents that code (`///<`), and so do comment lines below it that start in its column.
Comment text is escaped where Doxygen would read it as markup: `\\`, `@` and `<` (names such as `<unk>`, `<path>`).
"""
import re
import sys

WHOLE_LINE = re.compile(r"^(\s*)//(?!/)(.*)$")
# Code, then at least two spaces and `// `: a trailing comment. Lines that only close a scope ("}  // namespace") and
# preprocessor lines other than #define keep their comments as they are.
NOT_PREPROCESSOR = r"(?!#\s*(?:include|if|ifdef|ifndef|elif|else|endif|pragma)\b)"
TRAILING = re.compile(r"^(\s*" + NOT_PREPROCESSOR + r"[^\s}].*?\S)(\s{2,})//(?!/) ?(.*)$")


def escape(text):
    text = text.replace("\\", "\\\\").replace("@", "\\@").replace("<", "\\<")
    return re.sub(r"(?<![\w>])::", r"\\::", text)  # "::signatures" is not a link to resolve


def filter_header(lines):
    out = []
    in_head = True  # still in the comment block that opens the file
    head_end = None
    trailing_column = None  # column of the `//` of the previous line's trailing comment
    for line in lines:
        body = line.rstrip("\n")
        whole = WHOLE_LINE.match(body)
        if in_head:
            if whole:
                out.append(whole.group(1) + "///" + escape(whole.group(2)))
                head_end = len(out) - 1
                continue
            in_head = False
            if head_end is not None:
                out[head_end] += " @file"
        if whole:
            column = len(whole.group(1))
            marker = "///<" if trailing_column is not None and column == trailing_column else "///"
            if marker == "///":
                trailing_column = None
            out.append(whole.group(1) + marker + escape(whole.group(2)))
            continue
        trailing = TRAILING.match(body)
        if trailing and trailing.group(1).count('"') % 2 == 0:
            code, gap, text = trailing.groups()
            trailing_column = len(code) + len(gap)
            out.append(code + gap + "///< " + escape(text))
            continue
        trailing_column = None
        out.append(body)
    if in_head and head_end is not None:
        out[head_end] += " @file"
    return out


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        lines = f.readlines()
    sys.stdout.write("\n".join(filter_header(lines)) + "\n")


if __name__ == "__main__":
    main()
