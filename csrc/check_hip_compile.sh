#!/usr/bin/env bash
# Compile every csrc/**/*.hip twice over; fail if any compile fails:
#  * hipcc (Debian's, ROCm 5.2) for gfx90a (MI250X) with -Werror, and check the object has gfx90a code;
#  * nvcc for sm_80 and sm_90 with exactly `nvcc -x cu -std=c++17 -arch=sm_XX -c FILE -I<its dir> -I csrc`
#    (csrc/common/wave64.h detects the compiler, so no defines), where nvcc is installed; skipped with a
#    message where it is not.
# Device code only: the .hip files include no torch headers, so no ROCm or CUDA torch is needed.
# Installs hipcc + libamdhip64-dev when missing, if running as root with apt available.
# Runs CHECK_HIP_JOBS compiles at a time (default 2: CI machines have 2 cores).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
arch="${HIP_OFFLOAD_ARCH:-gfx90a}"
cuda_archs=(sm_80 sm_90)
max_jobs="${CHECK_HIP_JOBS:-2}"

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

# Debian's hipcc picks the NVIDIA platform when an nvcc is on PATH: the hipcc half is for AMD devices.
export HIP_PLATFORM=amd
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

# Largest first: the longest compiles start early, so the 2-job pool drains evenly.
mapfile -t files < <(find "$here" -name '*.hip' -printf '%s %p\n' | sort -k1,1nr -k2 | cut -d' ' -f2-)
if [ "${#files[@]}" -eq 0 ]; then
  echo "check_hip_compile: no .hip files under $here" >&2
  exit 1
fi

# One compile: prints one ok/FAIL line (the compiler's output only on failure), records a failure in $out.
compile() {
  local kind="$1" target="$2" f="$3"
  local rel="${f#"$here"/}"
  local obj
  obj="$out/$(echo "$rel" | tr '/' '_').$target.o"
  local log="$obj.log"
  local ok=0
  if [ "$kind" = hipcc ]; then
    # -Werror on the kernel sources: a warning such as a failed unroll is a performance bug on the device.
    if hipcc --offload-arch="$target" -O3 -std=c++17 -Werror -I "$(dirname "$f")" -I "$here" -c "$f" -o "$obj" \
      >"$log" 2>&1 && grep -a "amdgcn-amd-amdhsa--$target" "$obj" >/dev/null; then
      ok=1
    fi
  else
    # ptxas records its options in the object: "-arch sm_XX" shows the cubin was built for that target.
    if nvcc -x cu -std=c++17 -arch="$target" -Werror all-warnings -c "$f" -I "$(dirname "$f")" -I "$here" \
      -o "$obj" >"$log" 2>&1 && grep -a -- "-arch $target" "$obj" >/dev/null; then
      ok=1
    fi
  fi
  if [ "$ok" = 1 ]; then
    echo "ok    $rel ($kind $target)"
  else
    echo "FAIL  $rel ($kind $target)" >&2
    cat "$log" >&2
    touch "$out/failed"
  fi
}

# nvcc first: its compiles take about twice as long as hipcc's.
jobs_list=()
if command -v nvcc >/dev/null 2>&1; then
  for f in "${files[@]}"; do
    for a in "${cuda_archs[@]}"; do
      jobs_list+=("nvcc|$a|$f")
    done
  done
else
  echo "check_hip_compile: nvcc not found; skipping the NVIDIA (sm_80/sm_90) compiles"
fi
for f in "${files[@]}"; do
  jobs_list+=("hipcc|$arch|$f")
done

start=$SECONDS
for job in "${jobs_list[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$max_jobs" ]; do
    wait -n || true
  done
  IFS='|' read -r kind target f <<<"$job"
  compile "$kind" "$target" "$f" &
done
wait
echo "check_hip_compile: ${#jobs_list[@]} compiles in $((SECONDS - start)) s ($max_jobs at a time)"
[ ! -e "$out/failed" ]
