#!/usr/bin/env bash
# The test command (README "Quick start"; .ci/run calls exactly this). Sets up .venv/ if needed, checks
# that every HIP kernel compiles for gfx90a, then runs the whole pytest suite; fails on a skip outside tests/gpu
# whose reason is not on tests/skip_allowlist.txt.
# Extra arguments go to pytest (e.g. `bash tests/run.sh -k zero`).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=tools/setup_venv.sh
source tools/setup_venv.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# The Frontier scripts are linted by shellcheck in tests/unit/test_launch_scripts.py (Debian package; root only).
if ! command -v shellcheck >/dev/null 2>&1 && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck >/dev/null) \
    || echo "warning: could not install shellcheck; its test will be skipped" >&2
fi

# The import contracts of pyproject.toml (layers point down, no cycles; docs/architecture.md): a few seconds.
if ! lint_out="$(lint-imports --no-cache 2>&1)"; then
  printf '%s\n' "$lint_out" | sed -n '/Broken contracts/,$p' >&2
  echo "error: lint-imports: an import breaks the layers or makes a cycle (above); see docs/architecture.md" >&2
  exit 1
fi
echo "lint-imports: $(printf '%s\n' "$lint_out" | grep -E '^Contracts: ')"


# tests/skips.py records every skip; after pytest, a skip outside tests/gpu whose reason is not on
# tests/skip_allowlist.txt fails the run, and the skips are printed grouped by reason.
report="$(mktemp "${TMPDIR:-/tmp}/skips.XXXXXX.json")"
campaign_report="$(mktemp "${TMPDIR:-/tmp}/skips-campaign.XXXXXX.json")"
campaign_log="$(mktemp "${TMPDIR:-/tmp}/campaign.XXXXXX.log")"
hip_log="$(mktemp "${TMPDIR:-/tmp}/hip.XXXXXX.log")"
trap 'rm -f "$report" "$campaign_report" "$campaign_log" "$hip_log"' EXIT
# The HIP builds (~30 s of compiles) run beside pytest: the multi-process tests leave cores idle while ranks wait.
hip_pid=""
hip_rc=0
if [ "${SKIP_HIP_CHECK:-0}" != "1" ]; then
  nice -n 10 bash csrc/check_hip_compile.sh >"$hip_log" 2>&1 &
  hip_pid=$!
fi
hip_done() {  # wait for the HIP builds once; print their output
  if [ -n "$hip_pid" ]; then
    wait "$hip_pid"
    hip_rc=$?
    hip_pid=""
    echo "---- HIP builds (ran beside the above) ----"
    cat "$hip_log"
  fi
}
pytest_=("$PYTHON" -m pytest -q -p no:cacheprovider -p tests.skips --durations=40)
set +e
if [ "$#" -eq 0 ]; then
  # The whole suite. tests/campaign (stand-in Slurm campaigns: jobs whose steps and saves are slowed by sleeps, job
  # windows of a minute) mostly waits, so it runs beside the rest on two workers of its own, its output printed
  # after. The rest: three pytest-xdist workers on the two cores, a module per worker (module fixtures start once;
  # most tests are multi-process runs that leave a core idle while they rendezvous, save or wait for a watchdog:
  # two workers kept the cores about half busy). They run at a lower priority (nice 10) than the campaigns, whose
  # job windows are calibrated on a straight run's start-up: at equal priority a busy stretch of the workers made
  # later jobs start so slowly that the end-of-training evaluation never fitted. The campaigns' ranks use little
  # CPU (about 2 minutes in all). Then the tests marked `serial` (they compare ranks' wall times) alone.
  "${pytest_[@]}" --skip-report="$campaign_report" -n 2 --dist loadscope -m "not serial" tests/campaign \
    >"$campaign_log" 2>&1 &
  campaign_pid=$!
  nice -n 10 "${pytest_[@]}" --skip-report="$report" -n "${MF_TEST_WORKERS:-3}" --dist loadscope \
    -m "not serial" --ignore=tests/campaign
  rc_parallel=$?
  wait "$campaign_pid"
  rc_campaign=$?
  echo "---- tests/campaign (ran beside the above) ----"
  cat "$campaign_log"
  hip_done
  "${pytest_[@]}" --skip-report="$report" -m serial
  rc_serial=$?
  # The first real failure wins; "no tests collected" (5) only when neither phase ran anything.
  rc=0
  for r in "$rc_parallel" "$rc_campaign" "$rc_serial"; do
    if [ "$r" -ne 0 ] && [ "$r" -ne 5 ]; then rc=$r; break; fi
  done
  if [ "$rc" -eq 0 ] && [ "$rc_parallel" -eq 5 ] && [ "$rc_campaign" -eq 5 ] && [ "$rc_serial" -eq 5 ]; then rc=5; fi
else
  # Extra arguments: one pytest run with exactly them (add `-n 2` for workers).
  "${pytest_[@]}" --skip-report="$report" "$@"
  rc=$?
fi
hip_done
set -e
skips_rc=0
if [ -s "$report" ]; then
  "$PYTHON" -m tests.skips "$report" "$campaign_report" tests/skip_allowlist.txt || skips_rc=$?
else
  echo "error: pytest wrote no skip report ($report)" >&2
  skips_rc=1
fi
if [ "$rc" -eq 5 ]; then
  # pytest's "no tests collected": a suite that ran nothing must not pass.
  echo "error: pytest collected no tests (exit code 5); check the test paths and -k/-m filters" >&2
  exit 1
fi
if [ "$rc" -ne 0 ]; then
  exit "$rc"
fi
if [ "$hip_rc" -ne 0 ]; then
  echo "error: a HIP build failed (above): csrc/check_hip_compile.sh" >&2
  exit "$hip_rc"
fi
exit "$skips_rc"
