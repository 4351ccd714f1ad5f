#!/bin/sh
# The GPU check (benchmarks/gpu_check.py) on one GPU; arguments pass through (e.g. --device cpu).
exec python "$(dirname "$0")/gpu_check.py" "$@"
