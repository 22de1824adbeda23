#!/usr/bin/env python3
"""Reports C++ functions longer than a limit (150 lines by default) outside tests/.

usage: scripts/check_function_length.py [ROOT] [--max N] [--list M] [--self-test]

A function is a body at namespace or class scope whose head has a parameter list (free
functions, member functions defined in or out of their class, constructors, macros such as
PYBIND11_MODULE); lambdas and local classes count as part of the function they are in. Its
length runs from the first line of its head (the line of its name, after any template<...>)
to its closing brace, as a reader sees it. Exit 1, naming each one, when any is over the
limit; `--list M` also prints every function over M lines (a report, not a failure).

The scan is lexical, not a compiler's: comments, string and character literals and
preprocessor lines are blanked first, and a brace after an identifier in a constructor's
initializer list is an initializer, not a body.
"""
import argparse
import os
import re
import subprocess
import sys

SOURCE_EXT = (".cc", ".h", ".cpp", ".cu", ".hpp")
SKIP_TOP = {"tests", "build", "third_party"}
CONTAINER = re.compile(r"\b(namespace|class|struct|union|enum)\b|extern\s*\"C\"|^\s*extern\s*$")


def blank(text):
    """Comments, literals and preprocessor lines replaced by spaces; newlines kept."""
    out = []
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c == "#":
            # A preprocessor line, with its continuations.
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append(" \n")
                    i += 2
                    continue
                out.append(" ")
                i += 1
            continue
        if c == "/" and text.startswith("//", i):
            while i < n and text[i] != "\n":
                out.append(" ")
                i += 1
            continue
        if c == "/" and text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
            continue
        if c == "R" and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if m:
                close = ")" + m.group(1) + '"'
                end = text.find(close, i + m.end())
                end = n if end < 0 else end + len(close)
                out.append(re.sub(r"[^\n]", " ", text[i:end]))
                i = end
                continue
        if c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():  # a digit separator: 1'000
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(" " * (min(j + 1, n) - i))
            i = j + 1
            continue
        out.append(c)
        line_start = c == "\n" or (line_start and c in " \t")
        i += 1
    return "".join(out)


def is_function_head(head):
    h = re.sub(r"\btemplate\s*<[^{};]*?>\s*", "", head).strip()
    if not h or CONTAINER.search(h):
        return False
    if "(" not in h or ")" not in h:
        return False
    # A variable's initializer (`const auto kF = [] ...`), not a body; operator= is a name.
    depth = 0
    for k, ch in enumerate(h):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "=" and depth == 0:
            before = h[:k].rstrip()
            if not before.endswith("operator") and h[k + 1:k + 2] != "=" and h[k - 1:k] not in "=!<>":
                return False
    return True


def functions(path):
    """(name, first line, last line) of every function in the file."""
    text = blank(open(path, encoding="utf-8", errors="replace").read())
    found = []
    stack = []  # per open brace: "container", "function", "init" or "block"
    head_start = 0  # where the current head began (after the last ; { or })
    func_start = None
    for i, c in enumerate(text):
        if c == ";":
            head_start = i + 1
        elif c == "{":
            head = text[head_start:i]
            in_function = "function" in stack
            prev = head.rstrip()[-1:] if head.strip() else ""
            if in_function:
                kind = "block"
            elif (prev.isalnum() or prev in "_>") and re.search(r"\)\s*:", head) and not CONTAINER.search(head):
                kind = "init"  # a member's brace initializer inside a constructor's init list
            elif CONTAINER.search(re.sub(r"\btemplate\s*<[^{};]*?>\s*", "", head)):
                kind = "container"
            elif is_function_head(head):
                kind = "function"
                offset = re.match(r"\s*(template\s*<[^{};]*?>\s*)*", head).end()
                first = text.count("\n", 0, head_start + offset) + 1
                name = re.sub(r"\s+", " ", head[offset:].strip().split("(")[0])[-60:]
                func_start = (name, first)
            else:
                kind = "block"
            stack.append(kind)
            if kind != "init":
                head_start = i + 1
        elif c == "}":
            kind = stack.pop() if stack else "block"
            if kind == "function" and func_start:
                name, first = func_start
                found.append((name, first, text.count("\n", 0, i) + 1))
                func_start = None
            if kind != "init":
                head_start = i + 1
    return found


def self_test():
    """The scanner on known snippets; returns the failures (tests/CMakeLists.txt runs it)."""
    import tempfile
    body = "\n".join(f"  x += {k};" for k in range(147))
    cases = {
        # name -> (source, {function name: lines})
        "150 lines": ("namespace a {\nint F(int x) {\n" + body + "\n  return x;\n}\n}\n",
                      {"int F": 150}),
        "152 lines, lambda inside": ("int G() {\n  auto f = [] {\n" + body +
                                     "\n  };\n  return 0;\n}\n", {"int G": 152}),
        "ctor init braces, class": ("struct S {\n  S(int a) : v_{a}, w_(a) {\n    Go();\n  }\n"
                                    "  int v_, w_;\n};\n", {"S": 3}),
        "braces in literals": ('void H() {\n  const char* s = "}{";\n  char c = \'}\';\n'
                               '  // }\n  /* { */\n}\nvoid I() {\n}\n',
                               {"void H": 6, "void I": 2}),
        "macro body, template": ("#define M(x) { x }\ntemplate <typename T>\nT J(T t) {\n"
                                 "  return t;\n}\nPYBIND11_MODULE(_C, m) {\n  m.def();\n}\n",
                                 {"T J": 3, "PYBIND11_MODULE": 3}),
        "initializer, not a body": ("const int kA[] = {1, 2};\nauto kF = [](int x) {\n"
                                    "  return x;\n};\n", {}),
    }
    failures = []
    with tempfile.TemporaryDirectory() as d:
        for name, (src, want) in cases.items():
            path = os.path.join(d, "x.cc")
            with open(path, "w") as f:
                f.write(src)
            got = {n: last - first + 1 for n, first, last in functions(path)}
            if got != want:
                failures.append(f"{name}: got {got}, want {want}")
    return failures


def sources(root):
    files = subprocess.run(["git", "-C", root, "ls-files"], capture_output=True, text=True,
                           check=True).stdout.split()
    return [f for f in files if f.endswith(SOURCE_EXT) and f.split("/")[0] not in SKIP_TOP]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root", nargs="?", default=os.path.join(os.path.dirname(__file__), ".."))
    ap.add_argument("--max", type=int, default=150)
    ap.add_argument("--list", type=int, default=0)
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        failures = self_test()
        print("\n".join(failures) or "self-test: ok")
        return 1 if failures else 0
    over, listed = [], []
    for f in sources(args.root):
        for name, first, last in functions(os.path.join(args.root, f)):
            lines = last - first + 1
            if lines > args.max:
                over.append((lines, f, first, name))
            elif args.list and lines > args.list:
                listed.append((lines, f, first, name))
    for lines, f, first, name in sorted(listed, reverse=True):
        print(f"{f}:{first}: {name}: {lines} lines")
    for lines, f, first, name in sorted(over, reverse=True):
        print(f"{f}:{first}: {name}: {lines} lines, over {args.max}")
    if over:
        print(f"{len(over)} function(s) over {args.max} lines: split them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
