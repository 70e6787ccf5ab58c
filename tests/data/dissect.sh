#!/usr/bin/env bash
# Writes NAME.fields.tsv for a RoCEv2 capture with tshark, with the field list the
# linux-rdma harness used for the shared captures (ipv6.src/dst for IPv6 ones).
#   tests/data/dissect.sh tests/data/rxe_ipv6.pcap
set -euo pipefail
pcap=$1
out=${pcap%.pcap}.fields.tsv
ip=ip
[[ ${IPV6:-auto} == 1 ]] && ip=ipv6
if [[ ${IPV6:-auto} == auto ]] && tshark -r "$pcap" -Y ipv6 -c 1 -T fields -e frame.number 2>/dev/null | grep -q .; then ip=ipv6; fi
fields=(frame.number $ip.src $ip.dst udp.srcport udp.dstport infiniband.bth.opcode infiniband.bth.se
  infiniband.bth.m infiniband.bth.padcnt infiniband.bth.p_key infiniband.bth.destqp infiniband.bth.a
  infiniband.bth.psn infiniband.deth.q_key infiniband.deth.srcqp infiniband.reth.va infiniband.reth.r_key
  infiniband.reth.dmalen infiniband.aeth.syndrome infiniband.aeth.msn infiniband.atomiceth.swapdt
  infiniband.atomiceth.cmpdt infiniband.atomicacketh.origremdt infiniband.mad.mgmtclass
  infiniband.mad.method infiniband.mad.attributeid infiniband.invariant.crc _ws.col.Info)
args=()
for f in "${fields[@]}"; do args+=(-e "$f"); done
tshark --disable-heuristic rpcrdma_infiniband --disable-heuristic smb_direct_infiniband \
  -r "$pcap" -Y infiniband -T fields -E header=y -E separator=/t -E occurrence=a "${args[@]}" >"$out" 2>/dev/null
echo "wrote $out ($(($(wc -l <"$out") - 1)) packets)"
