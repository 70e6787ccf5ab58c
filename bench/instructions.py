#!/usr/bin/env python3
"""Instructions per operation on softrdma's hot paths, counted by callgrind.

Timings on this machine's VMs move 20-50 % from minute to minute; instruction
counts do not. This runs the client of a `softrdma perf` test (the server,
for the -server case) under valgrind's callgrind twice, with two iteration
counts, and divides the difference by the difference of the counts:
start-up, connection and reporting cancel out, and what is left is one
iteration's work in that process (the other runs natively).

    sudo bench/instructions.py                 # the default cases below
    sudo bench/instructions.py --case shm-write-8

Cases:
  roce-lat     busy-poll 8-byte WRITE ping-pong over RoCEv2: one round trip
               of the client (its half: the peer's WRITE and ACK in, its own
               WRITE and ACK out), and the stretches on the critical path:
               receiving a datagram (`receive_datagram`, inclusive), the
               polling thread's looks that take it (`poll_now`, inclusive,
               which holds `receive_datagram`) and posting the next WRITE
               (`Qp::post_send`, inclusive)
  roce-bw-64k  RoCEv2 WRITE 64 KiB (16 packets): the sender's work per WRITE
  shm-write-8  shared-memory 8-byte WRITE: one post (one completion in 100)
  roce-read-64k-server
               RoCEv2 READ 64 KiB (16 response packets): the responder's work
               per READ, in the server

The total per iteration also holds what the perf harness does per
iteration (building WRs, timing) and some of its reporting (sorting the
latencies grows a little faster than the count); the inclusive figures of
the library's entry points hold only softrdma's work.

The client under valgrind runs some 50 times slower than its peer, so it
finds the peer's answer at its first look: the counts are of the work, not
of the empty looks a native run spins through. Needs root (a private
network namespace, as bench/compare.py) and valgrind (installed with apt if
missing).
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from compare import in_namespace, isolate

REPO = Path(__file__).resolve().parent.parent
BIN = REPO / "target/release/softrdma"
SERVER_IP, CLIENT_IP = "127.0.0.91", "127.0.0.92"

# name: (perf arguments, the two iteration counts, functions to report
# inclusive, the side counted)
CASES = {
    "roce-lat": (["write-lat", "--provider", "roce", "--busy-poll", "-s", "8"], (10000, 30000),
                 ["provider::udp::receive_datagram", "provider::udp::poll_now",
                  "verbs::Qp::post_send"], "client"),
    # Above 20 000 iterations perf (as perftest) keeps no peak figure, whose
    # search grows faster than the count and would not cancel out.
    "roce-bw-64k": (["write-bw", "--provider", "roce", "-s", "65536"], (20100, 20700),
                    ["provider::udp::send_packets", "engine::rc::RcQp::poll_transmit"],
                    "client"),
    "shm-write-8": (["write-bw", "--provider", "shm", "-s", "8"], (100000, 300000),
                    ["verbs::Qp::post_send"], "client"),
    "roce-read-64k-server": (["read-bw", "--provider", "roce", "-s", "65536"], (3000, 6000),
                             ["provider::udp::send_packets", "engine::rc::RcQp::poll_transmit"],
                             "server"),
}


def parse(path):
    """Self cost per function, and inclusive cost (and calls) of every
    function as a callee, from a callgrind output file."""
    names, fn, cfn, call = {}, None, None, None
    self_cost, incl, calls = collections.Counter(), collections.Counter(), collections.Counter()
    name_re = re.compile(r"c?fn=\((\d+)\)(?: (.*))?")
    for line in open(path):
        if line.startswith(("fn=", "cfn=")):
            m = name_re.match(line.strip())
            if m.group(2):
                names[m.group(1)] = m.group(2)
            if line.startswith("fn="):
                fn = names[m.group(1)]
            else:
                cfn = names[m.group(1)]
            continue
        if line.startswith("calls="):
            call = int(line.split("=")[1].split()[0])
            continue
        if line[:1].isdigit() or line[:1] in "+-*":
            cost = int(line.split()[-1])
            if call is not None:
                if cfn != fn:
                    incl[cfn] += cost
                    calls[cfn] += call
                call = None
            else:
                self_cost[fn] += cost
    return self_cost, incl, calls


def run_case(args, iters, out, port, side):
    """One run of the case: `side` under callgrind, the other natively."""
    perf = [str(BIN), "perf", *args, "-n", str(iters), "-p", str(port)]
    grind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    counted = side == "server"
    server = subprocess.Popen([*(grind if counted else []), *perf, "--bind", SERVER_IP],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # A server under valgrind takes a few seconds to listen.
        time.sleep(3 if counted else 0.3)
        client = subprocess.run([*([] if counted else grind), *perf, "--bind", CLIENT_IP,
                                 SERVER_IP], capture_output=True, text=True)
        if client.returncode != 0:
            sys.exit(f"client failed:\n{client.stderr[-2000:]}")
        _, err = server.communicate(timeout=120)
        if server.returncode != 0:
            sys.exit(f"server failed:\n{err[-2000:]}")
    finally:
        if server.poll() is None:
            server.kill()


def measure(case, top):
    args, (n1, n2), report, side = CASES[case]
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for k, n in enumerate((n1, n2)):
            out = os.path.join(tmp, f"cg.{n}")
            run_case(args, n, out, 18690 + k, side)
            files.append(parse(out))
    (s1, i1, c1), (s2, i2, c2) = files
    per = n2 - n1
    self_diff = {f: (s2.get(f, 0) - s1.get(f, 0)) / per for f in set(s1) | set(s2)}
    print(f"## {case}: softrdma perf {' '.join(args)} ({side}; {n1} and {n2} iterations)")
    print(f"instructions per iteration: {sum(self_diff.values()):.0f}")
    for want in report:
        for f in (f for f in i2 if f.endswith(want)):
            print(f"  {(i2[f] - i1.get(f, 0)) / per:8.0f} inclusive, "
                  f"{(c2[f] - c1.get(f, 0)) / per:.2f} calls: {f}")
    print("  most instructions (self, per iteration):")
    for f, v in sorted(self_diff.items(), key=lambda x: -x[1])[:top]:
        print(f"  {v:8.1f}  {f[:110]}")
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES),
                    help="a case to run (repeatable; default: all)")
    ap.add_argument("--top", type=int, default=15, help="functions to list per case")
    a = ap.parse_args()
    if not in_namespace() and os.geteuid() == 0:
        if shutil.which("valgrind") is None:
            subprocess.run(["apt-get", "install", "-y", "-q", "valgrind"], check=True)
        subprocess.run(["cargo", "build", "-q", "--release", "-p", "softrdma-cli"], cwd=REPO,
                       check=True)
    isolate("keeps the test's sockets on loopback, and apt installs valgrind")
    for case in a.case or list(CASES):
        measure(case, a.top)


if __name__ == "__main__":
    main()
