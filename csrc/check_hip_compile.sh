#!/usr/bin/env bash
# Compile every csrc/**/*.hip for gfx90a (MI250X) with Debian's hipcc; fail if any does not compile.
# Device code only: the .hip files include no torch headers, so no ROCm torch is needed.
# Installs hipcc + libamdhip64-dev when missing, if running as root with apt available.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
arch="${HIP_OFFLOAD_ARCH:-gfx90a}"

if ! command -v hipcc >/dev/null 2>&1 || [ ! -e /usr/include/hip/hip_runtime.h ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "check_hip_compile: installing hipcc libamdhip64-dev"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hipcc libamdhip64-dev >/dev/null
  else
    echo "check_hip_compile: hipcc not found; install it with: apt-get install hipcc libamdhip64-dev" >&2
    exit 1
  fi
fi

# Debian's hipcc picks the NVIDIA platform when an nvcc is on PATH: the check is for AMD devices.
export HIP_PLATFORM=amd
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

mapfile -t files < <(find "$here" -name '*.hip' | sort)
if [ "${#files[@]}" -eq 0 ]; then
  echo "check_hip_compile: no .hip files under $here" >&2
  exit 1
fi

failed=0
for f in "${files[@]}"; do
  rel="${f#"$here"/}"
  # -Werror on the kernel sources: a warning such as a failed unroll is a performance bug on the device.
  if hipcc --offload-arch="$arch" -O3 -std=c++17 -Werror -c "$f" -o "$out/$(basename "$f").o"; then
    if grep -a "amdgcn-amd-amdhsa--$arch" "$out/$(basename "$f").o" >/dev/null; then
      echo "ok    $rel ($arch)"
    else
      echo "FAIL  $rel: object has no $arch code object" >&2
      failed=1
    fi
  else
    echo "FAIL  $rel" >&2
    failed=1
  fi
done
exit "$failed"
