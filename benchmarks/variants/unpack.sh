#!/usr/bin/env bash
# Make the ignored folder variants/ hold exactly one variant per patch here (all of them, or those named:
# tma_loader ...): variants/<name>/ the files a patch touches, taken from HEAD (or from the commit in VARIANT_BASE, for
# a patch written against an older one) and patched, for `.ci/gpu_job variants` (README.md here says how), which runs
# every folder in variants/. What variants/ held before is removed.
set -euo pipefail
cd "$(dirname "$0")/../.."
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for patch in benchmarks/variants/*.patch; do names+=("$(basename "$patch" .patch)"); done
fi
rm -rf variants
for name in "${names[@]}"; do
  patch=benchmarks/variants/$name.patch
  for file in $(git apply --numstat "$patch" | cut -f3); do
    mkdir -p "variants/$name/$(dirname "$file")"
    git show "${VARIANT_BASE:-HEAD}:$file" > "variants/$name/$file"
  done
  git apply --unsafe-paths --directory="variants/$name" "$patch"
  echo "variants/$name: $(git apply --numstat "$patch" | cut -f3 | tr '\n' ' ')"
done
