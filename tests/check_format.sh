#!/usr/bin/env bash
# Fails if any C++ file of the repository breaks the repo's .clang-format (clang-format 14, Debian).
# Fix with: clang-format -i $(git ls-files '*.cpp' '*.h')   (run it until nothing changes)
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.cpp' '*.h')
clang-format --dry-run --Werror "${files[@]}"
echo "clang-format: ${#files[@]} files clean"
