#!/usr/bin/env bash
# Records tests/data/rxe_ipv6.pcap: RoCEv2 over IPv6 between two Linux rxe guests
# (ibv_rc_pingpong with a padded last packet, ibv_ud_pingpong with a padded
# datagram), using the link-local GID (index 0) that rxe gets once IPv6 is on.
# Needs the linux-rdma harness (../shared/peers/linux-rdma, built) and root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
harness=${LINUX_RDMA_HARNESS:-$here/../../../shared/peers/linux-rdma}
cache=${LINUX_RDMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/linux-rdma-peers}
share=$cache/share-ipv6
rm -rf "$share"; mkdir -p "$share"

srv='rdma-info
ibv_rc_pingpong -d rxe0 -g 0 -n 3 -s 1030 & P=$!; sleep 2; touch /mnt/share/rc-ready; wait $P
ibv_ud_pingpong -d rxe0 -g 0 -n 3 -s 509 & P=$!; sleep 2; touch /mnt/share/ud-ready; wait $P'
cli='w() { i=0; while [ ! -e /mnt/share/$1 ] && [ $i -lt 600 ]; do sleep 0.2; i=$((i+1)); done; }
w rc-ready; ibv_rc_pingpong -d rxe0 -g 0 -n 3 -s 1030 10.99.0.2
w ud-ready; ibv_ud_pingpong -d rxe0 -g 0 -n 3 -s 509 10.99.0.2'

IPV6=1 LINKS=rxe SHARE="$share" PCAP="$here/rxe_ipv6.pcap" PCAP_FILTER='udp port 4791' RUN_TIMEOUT=300 \
  "$harness/vm.sh" pair sa 10.99.0.2 "$srv" cb 10.99.0.3 "$cli"
