#!/usr/bin/env bash
# Make the ignored folder variants/ hold exactly one variant per patch here (all of them, or those named:
# tma_loader ...): variants/<name>/ the files a patch touches, taken from HEAD and patched, for `.ci/gpu_job variants`
# (README.md here says how), which runs every folder in variants/. A patch written against an older commit names it
# in a first line "Base: <commit>" (git apply skips text before the diff); VARIANT_BASE overrides both. What variants/
# held before is removed.
set -euo pipefail
cd "$(dirname "$0")/../.."
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for patch in benchmarks/variants/*.patch; do names+=("$(basename "$patch" .patch)"); done
fi
rm -rf variants
for name in "${names[@]}"; do
  patch=benchmarks/variants/$name.patch
  base=$(sed -n '1s/^Base: \([0-9a-f]*\)$/\1/p' "$patch")
  base=${VARIANT_BASE:-${base:-HEAD}}
  for file in $(git apply --numstat "$patch" | cut -f3); do
    mkdir -p "variants/$name/$(dirname "$file")"
    # a file the patch creates is not at the base: git apply writes it
    git cat-file -e "$base:$file" 2>/dev/null && git show "$base:$file" > "variants/$name/$file"
  done
  git apply --unsafe-paths --directory="variants/$name" "$patch"
  echo "variants/$name (from $base): $(git apply --numstat "$patch" | cut -f3 | tr '\n' ' ')"
done
