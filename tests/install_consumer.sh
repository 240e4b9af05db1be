#!/usr/bin/env bash
# Installs graft into a temporary prefix and builds + runs examples/ against it with
# find_package(graft): proves the installed headers, library and CMake package work.
set -euo pipefail
build=$1; src=$2
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" >/dev/null
test -x "$prefix/bin/graft"
test -f "$prefix/include/graft/train.h"
"$prefix/bin/graft" --help >/dev/null
cmake -S "$src/examples" -B "$prefix/ex" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$prefix/ex" >/dev/null
"$prefix/ex/train_mlp" | tee "$prefix/out.txt"
grep -q "step 5 loss" "$prefix/out.txt"
