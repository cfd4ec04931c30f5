#!/usr/bin/env bash
# Build build/gpu_wheels: the wheels bench/gpu_wheels.lock lists, for the lent GPU machine
# (Python 3.12, x86-64, no registry there), each checked against its recorded size and sha256.
#
#   bash bench/gpu_wheels.sh [PYTHON]      # PYTHON: a python with pip (default .venv/bin/python)
#
# The folder is ignored by git (build/) and travels with the device call's `carry`; the command
# DEVELOPERS.md gives installs it there with pip --no-index --no-deps --target. Run here, where a
# registry is reachable; an existing folder is emptied first, so it never holds two versions.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
LOCK=bench/gpu_wheels.lock
DEST=build/gpu_wheels
[ -x "$PY" ] || command -v "$PY" >/dev/null || {
  echo "gpu_wheels.sh: no python at '$PY'; give one with pip: bash bench/gpu_wheels.sh python3" >&2
  exit 2; }
# name==version from each locked file name (wheel names: name-version-tags.whl)
mapfile -t SPECS < <(grep -v '^#' "$LOCK" | awk 'NF {split($1, p, "-"); print p[1] "==" p[2]}')
rm -rf "$DEST" && mkdir -p "$DEST"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$DEST" "${SPECS[@]}"
total=0
while read -r file bytes sha _; do
  case "$file" in ''|'#'*) continue ;; esac
  got="$DEST/$file"
  [ -f "$got" ] || { echo "gpu_wheels.sh: pip did not fetch $file (see $LOCK)" >&2; exit 1; }
  size=$(stat -c %s "$got")
  [ "$size" = "$bytes" ] || { echo "gpu_wheels.sh: $file is $size bytes, $LOCK says $bytes" >&2; exit 1; }
  echo "$sha  $got" | sha256sum --check --quiet - || { echo "gpu_wheels.sh: $file: sha256 differs from $LOCK" >&2; exit 1; }
  total=$((total + size))
done < "$LOCK"
extra=$(ls "$DEST" | grep -vxF -f <(grep -v '^#' "$LOCK" | awk 'NF {print $1}') || true)
[ -z "$extra" ] || { echo "gpu_wheels.sh: not in $LOCK: $extra" >&2; exit 1; }
echo "$DEST: ${#SPECS[@]} wheels, $((total / 1048576)) MiB ($total bytes), as $LOCK lists them"
