#!/usr/bin/env bash
# Counts the public declarations of a class, from clang's AST (no build needed): methods
# (static, deleted and special members included), constructors, the destructor, nested types
# and aliases, data members; implicit ones are not counted. `-v` lists them.
# usage: scripts/public_face.sh [-v] HEADER CLASS     e.g. runtime/session.h Session
set -euo pipefail
cd "$(dirname "$0")/.."
verbose=0
if [[ "${1:-}" == -v ]]; then verbose=1; shift; fi
header=$1 cls=$2
clang++ -std=c++20 -I. -fsyntax-only -x c++ "$header" -Xclang -ast-dump \
  -Xclang -ast-dump-filter="$cls" 2>/dev/null |
  awk -v cls="$cls" -v verbose=$verbose '
    # The class definition starts a dump block; its direct children are the lines "|-X" / "`-X".
    /^CXXRecordDecl .* (class|struct) / {
      inside = ($0 ~ (" (class|struct) " cls " definition$")); access = ($0 ~ / struct /) ? "public" : "private"; next }
    !inside { next }
    /^[^|`]/ { inside = 0; next }
    /^[|`]-AccessSpecDecl/ { access = $NF; next }
    /^[|`]-(CXXMethodDecl|CXXConstructorDecl|CXXDestructorDecl|CXXRecordDecl|TypeAliasDecl|TypedefDecl|FieldDecl|VarDecl|FunctionTemplateDecl|EnumDecl)/ {
      if ($0 ~ / implicit /) next
      if (access == "public") {
        n++
        if (verbose) { sub(/^[|`]-/, ""); print }
      }
    }
    END { print n + 0 }'
