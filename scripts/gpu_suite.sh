#!/usr/bin/env bash
# Every GPU figure in one command (scripts/gpu_suite.py says what it runs): one JSON file under
# docs/benchmarks/gpu/, named by the date. Without a GPU it runs the CPU checks and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 scripts/gpu_suite.py "$@"
