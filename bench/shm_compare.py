#!/usr/bin/env python3
"""softrdma's shared-memory provider next to UCX's shared-memory transport
and memcpy, measured in one run on this machine (loopback only).

    bench/shm_compare.py [--rounds N]

Builds softrdma (release), installs UCX's ucx_perftest (apt, as root) if it is
missing, then runs each figure once per round, alternating, and prints a
markdown table of medians (min-max) with the ratios issue 7 sets targets
for. docs/performance.md has the figures of the last run.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = REPO / "target/release/softrdma"
PORT = [19700]


def port():
    PORT[0] += 1
    return PORT[0]


def pair(server, client, env=None, timeout=60):
    """Runs a server, then the client; the client's output."""
    env = {**os.environ, **(env or {})}
    s = subprocess.Popen(server, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    out = ""
    try:
        for _ in range(50):
            time.sleep(0.2)
            c = subprocess.run(client, capture_output=True, text=True, env=env, timeout=timeout)
            out = c.stdout + c.stderr
            if c.returncode == 0:
                break
    finally:
        try:
            s.wait(timeout=10)
        except subprocess.TimeoutExpired:
            s.kill()
    return out


def rows(out):
    r = []
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 4 and all(x.replace(".", "", 1).isdigit() for x in f):
            r.append([float(x) for x in f])
    return r


def softrdma(test, size, iters):
    """perf TEST --provider shm: BW average (MiB/s) or median latency (us)."""
    p = str(port())
    args = [test, "--provider", "shm", "-s", str(size), "-n", str(iters), "-p", p]
    out = pair([str(BIN), "perf", *args, "--bind", "127.0.0.91"],
               [str(BIN), "perf", *args, "--bind", "127.0.0.92", "127.0.0.91"])
    r = rows(out)
    if not r:
        sys.exit(f"softrdma perf {' '.join(args)} failed:\n{out}")
    return r[-1][4] if test.endswith("lat") else r[-1][3]


def ucx(test, size, iters, extra=()):
    """ucx_perftest over UCX_TLS=sm,self: bandwidth (MiB/s) or p50 (us)."""
    p = str(port())
    env = {"UCX_TLS": "sm,self"}
    out = pair(["ucx_perftest", "-p", p],
               ["ucx_perftest", "127.0.0.1", "-p", p, "-f", "-t", test, "-s", str(size),
                "-n", str(iters), *extra], env=env)
    last = [r for r in rows(out) if len(r) == 8]
    if not last:
        sys.exit(f"ucx_perftest {test} failed:\n{out}")
    return last[-1][1] if test.endswith("lat") else last[-1][5]


def memcpy(sizes):
    out = subprocess.run(["cargo", "run", "-q", "--release", "-p", "softrdma-cli", "--example",
                          "memcpy_bw", "--", *map(str, sizes)], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    return {int(a): float(b) for a, b in (l.split() for l in out.splitlines())}


MIB = 1048576 / 1e9  # MiB/s -> GB/s

FIGURES = [
    # name, softrdma, UCX, unit, target ratio (softrdma / UCX; None: shown only)
    ("WRITE 8 B latency p50 (us, half round trip)",
     lambda: softrdma("write-lat", 8, 100000), lambda: ucx("ucp_put_lat", 8, 100000, ("-w", "1000")),
     "us", ("<=", 3.0)),
    # Both sides move the same bytes per figure: 6.5 GB at 64 KiB, 6.3 GB
    # at 1 MiB (shorter runs let start-up and noise decide).
    ("WRITE 64 KiB (GB/s)", lambda: softrdma("write-bw", 65536, 100000) * MIB,
     lambda: ucx("ucp_put_bw", 65536, 100000, ("-w", "100")) * MIB, "GB/s", (">=", 1.0)),
    ("WRITE 1 MiB (GB/s)", lambda: softrdma("write-bw", 1048576, 6000) * MIB,
     lambda: ucx("ucp_put_bw", 1048576, 6000, ("-w", "20")) * MIB, "GB/s", (">=", 1.0)),
    ("READ 64 KiB (GB/s)", lambda: softrdma("read-bw", 65536, 100000) * MIB,
     lambda: ucx("ucp_get", 65536, 100000, ("-w", "100", "-O", "32")) * MIB, "GB/s",
     (">=", 1.0)),
    ("READ 1 MiB (GB/s)", lambda: softrdma("read-bw", 1048576, 6000) * MIB,
     lambda: ucx("ucp_get", 1048576, 6000, ("-w", "20", "-O", "32")) * MIB, "GB/s",
     (">=", 1.0)),
    ("READ 8 B latency p50 (us, round trip)", lambda: softrdma("read-lat", 8, 100000),
     None, "us", None),
    ("FETCH_ADD latency p50 (us, round trip)", lambda: softrdma("atomic-lat", 8, 100000),
     None, "us", None),
]


def fmt(vals):
    m = statistics.median(vals)
    return f"{m:.3g} ({min(vals):.3g}–{max(vals):.3g})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.rounds < 1:
        sys.exit("--rounds: at least 1")
    if not shutil.which("ucx_perftest"):
        if os.geteuid() != 0:
            sys.exit("ucx_perftest is missing: apt-get install ucx-utils (as root)")
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "ucx-utils"],
                       check=True)
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "softrdma-cli"], cwd=REPO,
                   check=True)
    ours = {f[0]: [] for f in FIGURES}
    theirs = {f[0]: [] for f in FIGURES}
    copies = {65536: [], 1048576: []}
    for r in range(a.rounds):
        print(f"round {r + 1} of {a.rounds}", file=sys.stderr)
        for name, mine, peer, _, _ in FIGURES:
            ours[name].append(mine())
            if peer:
                theirs[name].append(peer())
        for size, gbs in memcpy(list(copies)).items():
            copies[size].append(gbs)
    print(f"`bench/shm_compare.py --rounds {a.rounds}`, {time.strftime('%Y-%m-%d')}: medians "
          f"(min–max) of {a.rounds} alternating rounds\n")
    print("| figure | softrdma shm | UCX sm | ratio | target |")
    print("|---|---|---|---|---|")
    for name, _, peer, _, target in FIGURES:
        o = ours[name]
        if not peer:
            print(f"| {name} | {fmt(o)} | | | |")
            continue
        t = theirs[name]
        ratio = statistics.median(o) / statistics.median(t)
        met = ""
        if target:
            op, want = target
            ok = ratio <= want if op == "<=" else ratio >= want
            met = f"{op} {want} {'met' if ok else 'MISSED'}"
        print(f"| {name} | {fmt(o)} | {fmt(t)} | {ratio:.2f} | {met} |")
    for size, v in copies.items():
        print(f"| memcpy {size // 1024} KiB, one thread (GB/s) | | | | {fmt(v)} |")


if __name__ == "__main__":
    main()
