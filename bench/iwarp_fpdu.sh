#!/bin/bash
# iWARP FPDU size between two softrdma ends on loopback: perf write-bw and
# read-bw -R with MSS-sized ULPDUs (32000) and MPA's largest (max), alternating.
# Prints: test, ULPDU, size, BW average [MB/s]. docs/performance.md has figures.
set -u
cd "$(dirname "$0")/.." && cargo build --release -q -p softrdma-cli || exit 1
B=$PWD/target/release/softrdma
run() { # env test size iters
  ( env SOFTRDMA_IWARP_ULPDU=$1 $B perf $2 -R --bind 127.0.0.71 -p 19501 -s $3 -n $4 > /dev/null 2>&1 ) &
  sleep 0.3
  env SOFTRDMA_IWARP_ULPDU=$1 $B perf $2 -R 127.0.0.71 --bind 127.0.0.72 -p 19501 -s $3 -n $4 2>&1 | awk -v m=$1 -v t=$2 '/^ [0-9]/ {print t, m, $1, $4}'
  wait
}
for rep in 1 2 3; do
 for t in write-bw read-bw; do
  for s in 65536 1048576; do
   n=$(( s == 65536 ? 20000 : 2000 ))
   for m in 32000 max; do run $m $t $s $n; done
  done
 done
done
