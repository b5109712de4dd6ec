#!/usr/bin/env bash
# Two sets of gpu_suite.sh parts side by side on a 4-GPU host, one GPU pair each, within one call's time, their
# results packed into $OUT/pairs.tgz (a call brings back only a few files).
#
#   bash benchmarks/gpu_pairs.sh SECONDS "PARTS ON GPUS 0,1" "PARTS ON GPUS 2,3"
#   bash benchmarks/gpu_pairs.sh 540 "fsdp2" "tests_faults"
#   bash benchmarks/gpu_pairs.sh 540 "PATHS_CONFIGS=unsloth:1@notebook,unsloth:2@live paths" "PATHS_CONFIGS=unsloth:2 paths"
#
# A word NAME=VALUE in a set is a setting for that set's parts alone (no spaces in VALUE: settings both sets share
# come from the environment), so the two sets can run one part with different options.
#
# Each set runs on its own half of the host's CPUs (taskset), as on a 2-GPU host: a one-GPU process in place sizes
# its torch thread pool to the CPUs it may use, and its spinning pool took CPU time from the other set's ranks.
# Each set gets its own TMPDIR (unsloth's compile caches), results folder and log, and is interrupted at SECONDS
# (gpu_suite.sh's own part limits come first where they are shorter), so that the packing still happens before the
# call's limit. The wheels are installed once, before both sets start (gpu_suite.sh env).
set -uo pipefail
[ $# -eq 3 ] || { sed -n 2,10p "$0"; exit 2; }
seconds=$1
OUT=${OUT:-$PWD/gpu-out}
work=$(mktemp -d)
OUT=$work/env bash benchmarks/gpu_suite.sh env > "$work/env.log" 2>&1
cpus=$(nproc)
pair() {  # pair NAME GPUS CPUS WORDS: WORDS are parts and NAME=VALUE settings
  local settings=() parts=() word
  for word in $4; do
    case $word in *=*) settings+=("$word") ;; *) parts+=("$word") ;; esac
  done
  mkdir -p "$work/$1" "$work/tmp-$1"
  local pin=(taskset -c "$3")
  command -v taskset > /dev/null || pin=()
  env "${settings[@]}" CUDA_VISIBLE_DEVICES="$2" TMPDIR="$work/tmp-$1" OUT="$work/$1" "${pin[@]}" \
    timeout --signal=INT --kill-after=15 "$seconds" bash benchmarks/gpu_suite.sh "${parts[@]}" > "$work/$1.log" 2>&1
  echo "=== pair $1 (GPUs $2, CPUs $3: $4): exit $?" >> "$work/$1.log"
}
pair a 0,1 "0-$((cpus / 2 - 1))" "$2" &
pair b 2,3 "$((cpus / 2))-$((cpus - 1))" "$3" &
wait
rm -rf "$work"/tmp-*
mkdir -p "$OUT"
tar czf "$OUT/pairs.tgz" -C "$work" .
grep -h "^=== \|passed\|failed\|error" "$work"/env.log "$work"/a.log "$work"/b.log | tail -60
rm -rf "$work"
