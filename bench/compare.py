#!/usr/bin/env python3
"""softrdma next to its peers on this machine: one run, one table, one chart.

    sudo bench/compare.py [--rounds N] [--only REGEX] [--write-docs] [--samples FILE]

Installs the peers it needs (apt: iperf3, sockperf, ucx-utils, libfabric-dev,
gcc), builds softrdma (release) and bench/fi_rma.c (libfabric tcp RMA, the
project's own program), then runs every figure once per round, rounds
interleaved, a target's figures back to back (its ratios are medians of
one ratio per round), inside a fresh network namespace that has only loopback
(`unshare --net`): nothing listens on or sends to a real interface. Prints a
markdown table of medians (min-max) per stack, the targets of issues 7 and 8
as ratios from this run (beside each RoCEv2 target, the same ratio for
`roce_ceiling`: the datagrams with no transport; beside each iWARP target,
for `iwarp_ceiling`: the byte stream with no transport; see
`docs/performance.md`),
and the CPU time per GB moved; `--write-docs` also
writes them to docs/compare.md and the chart to docs/compare.svg.

softrdma's rows run `softrdma perf` (perftest's tests) between 127.0.0.91 and
127.0.0.92 over each provider: RoCEv2 over UDP, iWARP over TCP, shared memory.
"""

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = REPO / "target/release/softrdma"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "softrdma-bench"
FI_RMA = CACHE / "fi_rma"
LO = "127.0.0.1"
SERVER_IP, CLIENT_IP = "127.0.0.91", "127.0.0.92"
PORT = [21000]
APT = ["iperf3", "sockperf", "ucx-utils", "libfabric-dev", "gcc", "libc6-dev"]
# fabtests' fi_rma_bw over tcp (rdm), recorded in ../shared/peers/perf/
# results-2026-11-29-pooled.txt, with iperf3's single stream of that day at the
# same write size: our libfabric program is checked against them.
FABTESTS = {65536: (3.22, 1.83), 1048576: (4.94, 3.98)}

# The ceilings, each in both modes: a busy-poll target's ceiling spins as
# softrdma does there, a blocking one's blocks (busy-poll streams have a slow
# mode on this host that blocking ones do not, sixteenth session).
CEILING = "RoCEv2 datagrams, no engine"
CEILING_BUSY = "RoCEv2 datagrams busy-poll, no engine"
ICEILING = "iWARP stream, no engine"
ICEILING_BUSY = "iWARP stream busy-poll, no engine"
STACKS = ["softrdma RoCEv2", "softrdma RoCEv2 busy-poll", CEILING, CEILING_BUSY,
          "softrdma iWARP", "softrdma iWARP busy-poll", ICEILING, ICEILING_BUSY, "softrdma shm",
          "UDP", "TCP", "UCX tcp", "UCX sm",
          "libfabric tcp", "memcpy"]
# softrdma perf's provider and extra flags per column.
PROVIDER = {"softrdma RoCEv2": ("roce", []), "softrdma RoCEv2 busy-poll": ("roce", ["--busy-poll"]),
            "softrdma iWARP": ("iwarp", []), "softrdma iWARP busy-poll": ("iwarp", ["--busy-poll"]),
            "softrdma shm": ("shm", [])}
SIZES = [4096, 65536, 1048576]
KIB = {4096: "4 KiB", 65536: "64 KiB", 1048576: "1 MiB"}
MIB = 1048576 / 1e9  # MiB/s -> GB/s


def port():
    PORT[0] += 1
    return PORT[0]


def log(msg):
    print(f"[{time.strftime('%T')}] {msg}", file=sys.stderr, flush=True)


class Failed(Exception):
    pass


def children_cpu():
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def pair(server, client, env=None, timeout=90, server_stays=False):
    """Runs `server`, then `client` (retried while the server comes up).
    Returns the client's output and the CPU seconds both used (user and
    system, from the reaped children's rusage). A server that stays
    (sockperf's) is stopped once the client is done."""
    env = {**os.environ, **(env or {})}
    cpu_before = children_cpu()
    s = subprocess.Popen(server, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                         text=True)
    out = ""
    try:
        for _ in range(40):
            time.sleep(0.15)
            if s.poll() is not None:
                raise Failed(f"server {' '.join(server)} exited: {s.stdout.read()[-2000:]}")
            try:
                c = subprocess.run(client, capture_output=True, text=True, env=env,
                                   timeout=timeout)
            except subprocess.TimeoutExpired as e:
                raise Failed(f"client timed out: {' '.join(client)}\n{e.stdout}")
            out = c.stdout + c.stderr
            if c.returncode == 0:
                break
            if "refused" not in out.lower():
                raise Failed(f"{' '.join(client)}: exit {c.returncode}\n{out[-2000:]}")
        else:
            raise Failed(f"client never connected: {' '.join(client)}\n{out[-2000:]}")
        if server_stays:
            s.terminate()
        try:
            s.wait(timeout=15)
        except subprocess.TimeoutExpired:
            raise Failed(f"server did not end: {' '.join(server)}")
    finally:
        if s.poll() is None:
            s.kill()
            s.wait()
    return out, children_cpu() - cpu_before


def rows(out):
    r = []
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 4 and all(re.fullmatch(r"[\d.]+", x) for x in f):
            r.append([float(x) for x in f])
    return r


# ------------------------------------------------------------------ softrdma

def softrdma(stack, test, size, iters):
    p = str(port())
    prov, extra = PROVIDER[stack]
    args = [test, "--provider", prov, *extra, "-s", str(size), "-n", str(iters), "-p", p]
    out, cpu = pair([str(BIN), "perf", *args, "--bind", SERVER_IP],
                    [str(BIN), "perf", *args, "--bind", CLIENT_IP, SERVER_IP])
    r = rows(out)
    if not r:
        raise Failed(f"softrdma perf {' '.join(args)}:\n{out[-2000:]}")
    return r[-1], cpu


# Bandwidth runs move about 0.4 GB (4 KiB), 1.3 GB (64 KiB) and 2 GB (1 MiB)
# over the network stacks, ten times that over shared memory: a few tenths of
# a second each, nearer iperf3's second. Runs of 0.03-0.1 s (the counts until
# 2026-12-01) weighed a connection's first milliseconds and this machine's
# changes of pace more (softrdma iWARP WRITE 1 MiB, alternating 500 and 3000
# iterations: medians of five 3.99 and 4.53 GB/s).
BW_ITERS = {4096: 100000, 65536: 20000, 1048576: 2000}
FAST_BW_ITERS = {s: 10 * n for s, n in BW_ITERS.items()}


def soft_bw(stack, verb, size):
    iters = (FAST_BW_ITERS if stack == "softrdma shm" else BW_ITERS)[size]
    r, cpu = softrdma(stack, f"{verb.lower()}-bw", size, iters)
    gbs = r[3] * MIB
    res = {f"{verb} {KIB[size]}": gbs}
    if size == 1048576 and verb == "WRITE":
        res["CPU s per GB moved (WRITE 1 MiB, both ends)"] = cpu / (size * iters / 1e9)
    return res


def soft_lat(stack, verb, name):
    test = {"WRITE": "write-lat", "READ": "read-lat", "SEND": "send-lat",
            "FETCH_ADD": "atomic-lat"}[verb]
    # Busy-poll ping-pongs run long enough that their p99 is the steady
    # state's: this machine's scheduler can start both spinning ends on one
    # CPU, and takes some 60 ms to spread them (5000 iterations put that in
    # the p99).
    iters = 100000 if stack == "softrdma shm" else 50000 if "busy" in stack else 5000
    r, _ = softrdma(stack, test, 8, iters)
    return {f"{name} p50": r[4], f"{name} p99": r[7]}


def soft_rate(stack):
    # An iWARP WRITE completes once its bytes are in the socket (as on siw),
    # and the socket buffers hold some 8 MB: 200 000 8-byte FPDUs (5.6 MB)
    # could end before the peer has read half of them. 3 000 000 (84 MB)
    # keep the buffered part under a tenth.
    iters = 3000000 if "iWARP" in stack else 200000
    r, _ = softrdma(stack, "write-bw", 8, iters)
    return {"WRITE 8 B message rate (Mmsg/s)": r[4]}


# ------------------------------------------------------------------- peers

def iperf(size, udp=False):
    p = str(port())
    extra = ["-u", "-b", "0"] if udp else []
    out, cpu = pair(["iperf3", "-s", "-1", "-B", LO, "-p", p],
                    ["iperf3", "-c", LO, "-B", LO, "-p", p, "-t", "1", "-J", "-l", str(size),
                     *extra])
    try:
        got = json.loads(out[out.index("{"):])["end"]["sum_received"]
        bps, moved = got["bits_per_second"], got["bytes"]
    except (ValueError, KeyError) as e:
        raise Failed(f"iperf3: {e}\n{out[-2000:]}")
    return bps / 8 / 1e9, cpu / (moved / 1e9)


def tcp_bw(size):
    gbs, cpu_per_gb = iperf(size)
    res = {f"WRITE {KIB[size]}": gbs, f"SEND {KIB[size]}": gbs}
    if size == 1048576:
        res["CPU s per GB moved (WRITE 1 MiB, both ends)"] = cpu_per_gb
    return res


def udp_bw():
    gbs, _ = iperf(4096, udp=True)
    return {"WRITE 4 KiB": gbs, "SEND 4 KiB": gbs}


def sockperf(tcp, busy):
    p = str(port())
    extra = (["--tcp"] if tcp else []) + (["--nonblocked"] if busy else [])
    out, _ = pair(["sockperf", "sr", "-i", LO, "-p", p, *extra],
                  ["sockperf", "pp", "-i", LO, "-p", p, "-m", "64", "-t", "1", "--full-rtt",
                   *extra], server_stays=True)
    p50 = re.search(r"percentile 50\.000 =\s*([\d.]+)", out)
    p99 = re.search(r"percentile 99\.000 =\s*([\d.]+)", out)
    if not p50 or not p99:
        raise Failed(f"sockperf:\n{out[-2000:]}")
    kind = "busy-poll" if busy else "blocking"
    name = f"8 B latency, {kind} (us, half round trip)"
    return {f"{name} p50": float(p50.group(1)) / 2, f"{name} p99": float(p99.group(1)) / 2}


def ucx(tls, test, size, iters, extra=()):
    p = str(port())
    env = {"UCX_TLS": tls}
    if tls == "tcp":
        env["UCX_NET_DEVICES"] = "lo"
    out, _ = pair(["ucx_perftest", "-p", p],
                  ["ucx_perftest", LO, "-p", p, "-f", "-t", test, "-s", str(size), "-n", str(iters),
                   *extra], env=env)
    last = [r for r in rows(out) if len(r) == 8]
    if not last:
        raise Failed(f"ucx_perftest {test}:\n{out[-2000:]}")
    return last[-1]


def ucx_bw(tls, verb, size):
    # UCX tcp moves 0.5-1 GB/s here: half the counts keep it to a second or two.
    iters = FAST_BW_ITERS[size] if tls != "tcp" else BW_ITERS[size] // 2
    if verb == "WRITE":
        r = ucx(tls, "ucp_put_bw", size, iters, ("-w", "20"))
    else:
        r = ucx(tls, "ucp_get", size, iters, ("-w", "20", "-O", "32"))
    return {f"{verb} {KIB[size]}": r[5] * MIB}


def ucx_lat(tls):
    r = ucx(tls, "ucp_put_lat", 8, 100000 if tls != "tcp" else 10000, ("-w", "1000"))
    # ucx_perftest spins: a busy-poll figure. Its p99 is not printed.
    return {"8 B latency, busy-poll (us, half round trip) p50": r[1]}


def ucx_rate(tls):
    r = ucx(tls, "ucp_put_bw", 8, 1000000 if tls != "tcp" else 100000, ("-w", "1000"))
    return {"WRITE 8 B message rate (Mmsg/s)": r[7] / 1e6}


def fi(op, size, iters, window=64):
    p = str(port())
    args = ["-p", p, "-o", op, "-S", str(size), "-n", str(iters), "-W", str(window)]
    out, _ = pair([str(FI_RMA), *args], [str(FI_RMA), *args, LO])
    res = dict()
    for m in re.finditer(r"RESULT (\w+) (\d+) ([\d.]+) (\S+)", out):
        res[m.group(4)] = float(m.group(3))
    if not res:
        raise Failed(f"fi_rma {' '.join(args)}:\n{out[-2000:]}")
    return res


def fi_bw(verb, size):
    return {f"{verb} {KIB[size]}": fi(verb.lower(), size, BW_ITERS[size])["GB/s"]}


def fi_lat():
    r = fi("pingpong", 8, 20000)
    name = "8 B latency, busy-poll (us, half round trip)"
    return {f"{name} p50": r["us_half_rtt_p50"], f"{name} p99": r["us_half_rtt_p99"]}


def fi_rate():
    return {"WRITE 8 B message rate (Mmsg/s)": fi("rate", 8, 200000, 256)["Mmsg/s"]}


def run_ceiling(name, *args):
    out = subprocess.run([str(REPO / "target/release/examples" / name), *args],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise Failed(f"{name} {' '.join(args)}: {out.stderr[-2000:]}")
    return [float(x) for x in out.stdout.split()[1:]]


def roce_ceiling(*args):
    return run_ceiling("roce_ceiling", *args)


def mode(busy):
    return ["--busy"] if busy else []


def iwarp_ceiling_bw(size, busy):
    """iWARP's byte stream for WRITEs between softrdma ends (MPA's largest
    FPDUs, gathered from the region; each payload read straight into its
    place) with no transport, blocking or spinning."""
    args = ("stream", "1", str(size), *mode(busy))
    return {f"WRITE {KIB[size]}": run_ceiling("iwarp_ceiling", *args)[0]}


def ceiling_write(size, busy):
    """The datagrams of a RoCEv2 WRITE stream with only the mandatory work
    (an ICRC per packet on each side, one copy on receive, an ACK every 64
    packets) and no transport, sent from and written to buffers of the
    row's size as softrdma perf's are (busy-polling, the receiver pauses
    after an empty look, as softrdma's does in a stream): measured beside
    each size's WRITEs."""
    return {f"WRITE {KIB[size]}": roce_ceiling("stream", "1", str(size), *mode(busy))[0]}


def ceiling_read(size):
    """READs add their requests and the responses' AETHs (FIRST and LAST
    cannot share a MIDDLE's GSO send): their own stream, per size; spinning,
    as softrdma's READ rows do."""
    return {f"READ {KIB[size]}": roce_ceiling("read", "1", str(size), "--busy")[0]}


def ceiling_lat():
    """A WRITE ping-pong's datagrams (the WRITE and the ACK of the peer's, in
    one GSO send), their ICRCs checked and made, no transport; as many
    iterations as softrdma's busy-poll ping-pong, so that the p99s compare."""
    p50, p99 = roce_ceiling("pingpong", "50000")
    return {f"{LAT_BUSY} p50": p50, f"{LAT_BUSY} p99": p99}


def memcpy():
    out = subprocess.run(["cargo", "run", "-q", "--release", "-p", "softrdma-cli", "--example",
                          "memcpy_bw", "--", *map(str, SIZES)], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    res = {}
    for line in out.splitlines():
        size, gbs = line.split()
        res[f"WRITE {KIB[int(size)]}"] = res[f"READ {KIB[int(size)]}"] = float(gbs)
    return res


# ------------------------------------------------------------------- plan

LAT_BLOCK = "8 B latency, blocking (us, half round trip)"
LAT_BUSY = "8 B latency, busy-poll (us, half round trip)"


def measurements():
    """Every measurement of a round: {(stack, label): function}."""
    m = {}
    for stack in PROVIDER:
        for verb in ("WRITE", "READ", "SEND"):
            for size in SIZES:
                m[stack, f"{verb} {size}"] = lambda s=stack, v=verb, z=size: soft_bw(s, v, z)
        # softrdma perf waits for completions blocking; its WRITE ping-pong
        # spins on the target memory.
        lat_row = LAT_BUSY if "busy" in stack else LAT_BLOCK
        m[stack, "WRITE lat"] = lambda s=stack, r=lat_row: soft_lat(s, "WRITE", r)
        m[stack, "READ lat"] = lambda s=stack: soft_lat(
            s, "READ", "READ 8 B latency (us, round trip)")
        m[stack, "SEND lat"] = lambda s=stack: soft_lat(
            s, "SEND", "SEND 8 B latency (us, half round trip)")
        if "iWARP" not in stack:
            m[stack, "FETCH_ADD lat"] = lambda s=stack: soft_lat(
                s, "FETCH_ADD", "FETCH_ADD latency (us, round trip)")
        m[stack, "rate"] = lambda s=stack: soft_rate(s)
    for size in (65536, 1048576):
        for stack, icstack, busy in ((CEILING, ICEILING, False),
                                     (CEILING_BUSY, ICEILING_BUSY, True)):
            m[stack, f"WRITE {size}"] = lambda z=size, b=busy: ceiling_write(z, b)
            m[icstack, f"WRITE {size}"] = lambda z=size, b=busy: iwarp_ceiling_bw(z, b)
        m[CEILING_BUSY, f"READ {size}"] = lambda z=size: ceiling_read(z)
    m[CEILING_BUSY, "pingpong"] = ceiling_lat
    for size in SIZES:
        m["TCP", f"WRITE {size}"] = lambda z=size: tcp_bw(z)
    m["UDP", "WRITE 4096"] = udp_bw
    for tcp in (False, True):
        for busy in (False, True):
            m["TCP" if tcp else "UDP", f"sockperf busy={busy}"] = (
                lambda t=tcp, b=busy: sockperf(t, b))
    for tls, stack in (("tcp", "UCX tcp"), ("sm,self", "UCX sm")):
        for verb in ("WRITE", "READ"):
            for size in SIZES:
                m[stack, f"{verb} {size}"] = lambda t=tls, v=verb, z=size: ucx_bw(t, v, z)
        m[stack, "WRITE lat"] = lambda t=tls: ucx_lat(t)
        m[stack, "rate"] = lambda t=tls: ucx_rate(t)
    for verb in ("WRITE", "READ"):
        for size in SIZES:
            m["libfabric tcp", f"{verb} {size}"] = lambda v=verb, z=size: fi_bw(v, z)
    m["libfabric tcp", "WRITE lat"] = fi_lat
    m["libfabric tcp", "rate"] = fi_rate
    m["memcpy", "memcpy"] = memcpy
    return m


def groups():
    """The measurements of a target run back to back, so that its ratios pair
    figures taken seconds apart: this machine's pace changes (a probe's GSO
    sends moved 5.1 GB/s in one round and 1.8 in the next, fourteenth
    session), and a ratio of figures taken minutes apart measures that as
    much as the stacks."""
    R, B, I, IB = ("softrdma RoCEv2", "softrdma RoCEv2 busy-poll", "softrdma iWARP",
                   "softrdma iWARP busy-poll")
    fi, ucx, S, sm = "libfabric tcp", "UCX tcp", "softrdma shm", "UCX sm"
    g = []
    for size in (65536, 1048576):
        w = f"WRITE {size}"
        g.append([(B, w), (fi, w), (CEILING_BUSY, w), (ucx, w), (R, w), ("TCP", w),
                  (CEILING, w)])
    w = "WRITE 1048576"
    g[-1] += [(IB, w), (ICEILING_BUSY, w), (I, w), (ICEILING, w)]
    for size in (65536, 1048576):
        r = f"READ {size}"
        g.append([(B, r), (fi, r), (CEILING_BUSY, r)])
    g.append([(B, "WRITE lat"), (fi, "WRITE lat"), ("UDP", "sockperf busy=True"),
              (CEILING_BUSY, "pingpong")])
    g.append([(R, "WRITE lat"), ("UDP", "sockperf busy=False")])
    g.append([(B, "rate"), (fi, "rate")])
    g.append([(S, "WRITE lat"), (sm, "WRITE lat")])
    # Both shared-memory stacks copy once; memcpy, their ceiling, in the
    # middle of their group.
    shm = [(st, f"{verb} {size}") for verb in ("WRITE", "READ") for size in (65536, 1048576)
           for st in (S, sm)]
    g.append(shm[:4] + [("memcpy", "memcpy")] + shm[4:])
    return g


def plan(only):
    """The groups of a round, as lists of (stack, label, function): the
    targets' groups, then every other measurement, one to a group."""
    m = measurements()
    keep = [k for k in m if not only or re.search(only, f"{k[0]} {k[1]}")]
    grouped = [[k for k in grp if k in keep] for grp in groups()]
    seen = {k for grp in grouped for k in grp}
    grouped += [[k] for k in keep if k not in seen]
    return [[(k[0], k[1], m[k]) for k in grp] for grp in grouped if grp]


ROWS = ([f"{v} {KIB[s]}" for v in ("WRITE", "READ", "SEND") for s in SIZES]
        + [f"{LAT_BUSY} p50", f"{LAT_BUSY} p99", f"{LAT_BLOCK} p50", f"{LAT_BLOCK} p99",
           "READ 8 B latency (us, round trip) p50", "READ 8 B latency (us, round trip) p99",
           "SEND 8 B latency (us, half round trip) p50",
           "SEND 8 B latency (us, half round trip) p99",
           "FETCH_ADD latency (us, round trip) p50", "FETCH_ADD latency (us, round trip) p99",
           "WRITE 8 B message rate (Mmsg/s)", "CPU s per GB moved (WRITE 1 MiB, both ends)"])


def unit(row):
    """Bandwidth rows' unit; the others name theirs."""
    return "" if "latency" in row or "rate" in row or "CPU" in row else " (GB/s)"


# ---------------------------------------------------------------- targets

def paired(samples, a, b):
    """a / b for every round that measured both (their groups ran them back
    to back)."""
    x, y = samples.get(a, {}), samples.get(b, {})
    return [x[r] / y[r] for r in sorted(x) if r in y and y[r]]


def targets(samples):
    """Issue 8's and 7's targets as (what, ratios, ceiling ratios, op, want):
    the ratios one per round."""
    t = []

    def add(what, a, b, op, want, ceiling=None):
        t.append((what, paired(samples, a, b),
                  None if ceiling is None else paired(samples, ceiling, b), op, want))

    R, I, S = "softrdma RoCEv2", "softrdma iWARP", "softrdma shm"
    # Peers that spin (libfabric, UCX) against softrdma spinning; iperf3
    # and blocking sockperf against softrdma blocking.
    B, IB = "softrdma RoCEv2 busy-poll", "softrdma iWARP busy-poll"
    fi = "libfabric tcp"
    for size in ("64 KiB", "1 MiB"):
        w = f"WRITE {size}"
        add(f"RoCEv2 busy-poll WRITE {size} / libfabric tcp write", (B, w), (fi, w), ">=", 1.2,
            (CEILING_BUSY, w))
        add(f"RoCEv2 busy-poll WRITE {size} / UCX tcp put", (B, w), ("UCX tcp", w), ">=", 3.0,
            (CEILING_BUSY, w))
        add(f"RoCEv2 WRITE {size} / iperf3 TCP (same write size)", (R, w), ("TCP", w), ">=",
            1.0, (CEILING, w))
    for size in ("64 KiB", "1 MiB"):
        r = f"READ {size}"
        add(f"RoCEv2 busy-poll READ {size} / libfabric tcp read", (B, r), (fi, r), ">=", 1.5,
            (CEILING_BUSY, r))
    w = "WRITE 1 MiB"
    add("iWARP busy-poll WRITE 1 MiB / libfabric tcp write", (IB, w), (fi, w), ">=", 1.0,
        (ICEILING_BUSY, w))
    add("iWARP WRITE 1 MiB / iperf3 -l 1M", (I, w), ("TCP", w), ">=", 0.95, (ICEILING, w))
    busy, block = f"{LAT_BUSY} p50", f"{LAT_BLOCK} p50"
    add("RoCEv2 8 B WRITE latency, busy-poll / libfabric tcp ping-pong", (B, busy), (fi, busy),
        "<=", 0.8, (CEILING_BUSY, busy))
    add("RoCEv2 8 B WRITE latency, busy-poll / UDP busy-poll half round trip", (B, busy),
        ("UDP", busy), "<=", 1.3, (CEILING_BUSY, busy))
    add("RoCEv2 8 B WRITE latency, blocking / UDP blocking half round trip", (R, block),
        ("UDP", block), "<=", 1.1)
    rate = "WRITE 8 B message rate (Mmsg/s)"
    add("RoCEv2 busy-poll 8 B WRITE message rate / libfabric tcp", (B, rate), (fi, rate), ">=",
        2.0)
    add("shm 8 B WRITE latency / UCX sm put latency", (S, block), ("UCX sm", busy), "<=", 3.0)
    for verb in ("WRITE", "READ"):
        for size in ("64 KiB", "1 MiB"):
            v = f"{verb} {size}"
            add(f"shm {v} / UCX sm", (S, v), ("UCX sm", v), ">=", 1.0, ("memcpy", v))
    return t


# ------------------------------------------------------------------ output

def fmt(vals):
    if not vals:
        return ""
    m = statistics.median(vals)
    if len(vals) == 1:
        return f"{m:.3g}"
    return f"{m:.3g} ({min(vals):.3g}–{max(vals):.3g})"


def report(samples, rounds, failures):
    med = {k: statistics.median(v.values()) for k, v in samples.items() if v}
    used = [s for s in STACKS if any((s, r) in samples for r in ROWS)]
    lines = [f"`sudo bench/compare.py --rounds {rounds}`, {time.strftime('%Y-%m-%d')}: "
             f"medians (min–max) of {rounds} interleaved rounds, loopback in a private "
             "network namespace, this machine (2 vCPUs).", ""]
    lines.append("| figure | " + " | ".join(used) + " |")
    lines.append("|---" * (len(used) + 1) + "|")
    for row in ROWS:
        if not any((s, row) in samples for s in used):
            continue
        cells = [fmt(list(samples.get((s, row), {}).values())) for s in used]
        lines.append(f"| {row}{unit(row)} | " + " | ".join(cells) + " |")
    lines += ["", f"The ceiling column puts \"{CEILING}\" (`roce_ceiling`: softrdma's "
              "datagrams with only the work the wire and one copy make mandatory, no transport; "
              "sent from and written to buffers of the row's size, as softrdma perf's; "
              "for WRITEs, an ACK every 64 packets and, busy-polling, a receiver that pauses 10 µs "
              "after an empty look in a stream, as softrdma's does; for READs, a READ's own datagrams: its requests, and responses whose FIRST and "
              "LAST carry an AETH) "
              "in softrdma's place: a target the ceiling misses too is beyond what RoCEv2 over "
              "this machine's UDP sockets reaches. For the iWARP targets the ceiling is "
              f"\"{ICEILING}\" (`iwarp_ceiling`: the TCP byte stream of softrdma's WRITEs, "
              "MPA's largest FPDUs gathered from the region, each payload read straight into "
              "place, no transport); for the shared-memory bandwidths, memcpy (one thread "
              "copying between two buffers, the one copy both shared-memory stacks make; "
              "the better of glibc's memcpy and softrdma's copy). "
              "Each ceiling runs in the target's mode: a busy-poll target's spins "
              f"(\"{CEILING_BUSY}\", \"{ICEILING_BUSY}\"), a blocking one's blocks.", "",
              "Each ratio is the median (min–max) of one ratio per round, between figures "
              "its group measured back to back (every other round in reverse order); the "
              "ceiling's likewise.", "",
              "The rounds column counts the rounds whose own ratio meets the target, "
              "softrdma's and then the ceiling's: how reliably this machine reaches it.", "",
              "| target | ratio in this run | ceiling | wanted | rounds that meet it | |",
              "|---|---|---|---|---|---|"]

    def meets(r, op, want):
        return r <= want if op == "<=" else r >= want

    def ratio_cell(rs):
        if len(rs) == 1:
            return f"{rs[0]:.2f}"
        return f"{statistics.median(rs):.2f} ({min(rs):.2f}–{max(rs):.2f})"

    def rounds_cell(rs, op, want):
        return f"{sum(meets(r, op, want) for r in rs)} of {len(rs)}"

    for what, ratios, ceil, op, want in targets(samples):
        cell = ratio_cell(ceil) if ceil else ""
        if not ratios:
            lines.append(f"| {what} | not measured | {cell} | {op} {want} | | |")
            continue
        verdict = "met" if meets(statistics.median(ratios), op, want) else "MISSED"
        if verdict == "MISSED" and ceil and not meets(statistics.median(ceil), op, want):
            verdict = "MISSED; the ceiling misses it too"
        counts = rounds_cell(ratios, op, want)
        if ceil:
            counts += f"; ceiling {rounds_cell(ceil, op, want)}"
        lines.append(f"| {what} | {ratio_cell(ratios)} | {cell} | {op} {want} | {counts} "
                     f"| {verdict} |")
    # The libfabric program against fabtests' recorded figures (within
    # ±30 %); how fast TCP ran today against that day is shown beside.
    lines += ["", "| libfabric check | this run | fabtests 2026-11-29 | ratio | "
              "iperf3 today / that day |", "|---|---|---|---|---|"]
    for size, (fab, tcp_then) in FABTESTS.items():
        ours = med.get(("libfabric tcp", f"WRITE {KIB[size]}"))
        tcp_now = med.get(("TCP", f"WRITE {KIB[size]}"))
        if ours:
            r = ours / fab
            tcp = f"{tcp_now / tcp_then:.2f}" if tcp_now else ""
            lines.append(f"| fi_write {KIB[size]} (GB/s) | {ours:.3g} | {fab} | {r:.2f} "
                         f"({'within' if 0.7 <= r <= 1.3 else 'OUTSIDE'} ±30 %) | {tcp} |")
    # Busy polling spends a CPU to go faster: a figure it makes far slower
    # is a fault (the iWARP 8-byte rate fell to an eighth of blocking's in
    # one session's runs, unnoticed). The ceilings are listed too: where
    # theirs falls with softrdma's, the host's slow mode did it.
    slow = []
    for blocking, busy in (("softrdma RoCEv2", "softrdma RoCEv2 busy-poll"),
                           (CEILING, CEILING_BUSY),
                           ("softrdma iWARP", "softrdma iWARP busy-poll"),
                           (ICEILING, ICEILING_BUSY)):
        for row in ROWS:
            if "GB/s" not in unit(row) and "rate" not in row:
                continue
            a, b = med.get((blocking, row)), med.get((busy, row))
            if a and b and b < 0.5 * a:
                slow.append(f"| {busy} | {row}{unit(row)} | {b:.3g} | {a:.3g} | {b / a:.2f} |")
    lines += ["", "Busy-poll figures under half their blocking counterparts: "
              + (f"{len(slow)} (a fault to look into, unless the ceiling's fell too)."
                 if slow else "none."), ""]
    if slow:
        lines += ["| stack | figure | busy-poll | blocking | ratio |", "|---|---|---|---|---|"]
        lines += slow
    if failures:
        lines += ["", "Failed measurements (left out of the medians):", ""]
        lines += [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n", med


def svg(med):
    """Grouped horizontal bars, log scale: bandwidth and latency medians."""
    panels = [("Bandwidth, GB/s (log scale; longer is better)",
               [f"{v} {s}" for v in ("WRITE", "READ") for s in ("64 KiB", "1 MiB")]),
              ("8 B latency p50, µs (log scale; shorter is better)",
               [f"{LAT_BUSY} p50", f"{LAT_BLOCK} p50"])]
    colors = ["#1f77b4", "#aec7e8", "#c5b0d5", "#9edae5", "#ff7f0e", "#ffbb78", "#dbdb8d",
              "#bcbd22", "#2ca02c", "#7f7f7f", "#8c564b", "#d62728", "#9467bd", "#e377c2",
              "#17becf"]
    assert len(colors) >= len(STACKS)
    import math
    bar, gap, left, width = 9, 10, 330, 430
    out, y = [], 30
    for title, rws in panels:
        vals = [med[(s, r)] for r in rws for s in STACKS if (s, r) in med and med[(s, r)] > 0]
        if not vals:
            continue
        lo, hi = math.floor(math.log10(min(vals))), math.ceil(math.log10(max(vals)))
        hi = max(hi, lo + 1)
        out.append(f'<text x="10" y="{y}" font-weight="bold">{title}</text>')
        y += 12
        top = y
        for r in rws:
            present = [(i, s) for i, s in enumerate(STACKS) if (s, r) in med and med[(s, r)] > 0]
            if not present:
                continue
            label = r.replace(" (us, half round trip) p50", "")
            out.append(f'<text x="10" y="{y + bar * len(present) / 2 + 4}">{label}</text>')
            for i, s in present:
                val = med[(s, r)]
                w = width * (math.log10(val) - lo) / (hi - lo)
                out.append(f'<rect x="{left}" y="{y}" width="{max(w, 1):.1f}" height="{bar - 1}" '
                           f'fill="{colors[i]}"><title>{s}: {val:.3g}</title></rect>')
                out.append(f'<text x="{left + max(w, 1) + 3:.1f}" y="{y + bar - 1}" '
                           f'font-size="8">{s} {val:.3g}</text>')
                y += bar
            y += gap
        for e in range(lo, hi + 1):
            x = left + width * (e - lo) / (hi - lo)
            out.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{y}" stroke="#ccc"/>')
            out.append(f'<text x="{x:.1f}" y="{y + 10}" font-size="8" text-anchor="middle">'
                       f'{10.0 ** e:g}</text>')
        y += 30
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 150}" height="{y}" '
            f'font-family="sans-serif" font-size="10">\n'
            f'<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(out) + "\n</svg>\n")


# ------------------------------------------------------------------ set-up

def install():
    missing = [p for p, probe in (("iperf3", "iperf3"), ("sockperf", "sockperf"),
                                  ("ucx-utils", "ucx_perftest"), ("gcc", "gcc"))
               if not shutil.which(probe)]
    if not Path("/usr/include/rdma/fabric.h").exists():
        missing.append("libfabric-dev")
    if missing:
        if os.geteuid() != 0:
            sys.exit(f"missing {missing}: run as root (apt-get install {' '.join(APT)})")
        log(f"apt-get install {' '.join(APT)}")
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT],
                       check=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    CACHE.mkdir(parents=True, exist_ok=True)
    src = REPO / "bench/fi_rma.c"
    if not FI_RMA.exists() or FI_RMA.stat().st_mtime < src.stat().st_mtime:
        subprocess.run(["gcc", "-O2", "-Wall", "-o", str(FI_RMA), str(src), "-lfabric"],
                       check=True)
    log("building softrdma (release)")
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "softrdma-cli", "--example",
                    "memcpy_bw"], cwd=REPO, check=True)
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "softrdma-cli"], cwd=REPO,
                   check=True)
    for example in ("roce_ceiling", "iwarp_ceiling"):
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "softrdma", "--example",
                        example], cwd=REPO, check=True)


def in_namespace():
    """Whether this is the re-run inside the namespace `isolate` made."""
    return os.environ.get("SOFTRDMA_BENCH_NETNS") == "1"


def isolate(why="keeps every peer on loopback, and apt installs the peers"):
    """Re-runs this script in a new network namespace with only loopback."""
    if in_namespace():
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        return
    if os.geteuid() != 0:
        sys.exit(f"{sys.argv[0]} needs root: a private network namespace (unshare --net) {why}")
    env = {**os.environ, "SOFTRDMA_BENCH_NETNS": "1"}
    sys.exit(subprocess.run(["unshare", "--net", sys.executable, *sys.argv], env=env).returncode)


def regex(text):
    """An argument that must be a regular expression."""
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression: {e}")
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", type=regex,
                    help="measure the stacks/labels matching this regular expression")
    ap.add_argument("--write-docs", action="store_true",
                    help="write docs/compare.md and docs/compare.svg")
    ap.add_argument("--samples", type=Path, metavar="FILE",
                    help="also write every round's figures to FILE (JSON), for a closer look "
                         "than medians give")
    a = ap.parse_args()
    if a.rounds < 1:
        sys.exit("--rounds: at least 1")
    todo = plan(a.only)
    if not todo:
        sys.exit(f"--only {a.only!r}: matches no measurement (they are named \"STACK LABEL\", "
                 "e.g. \"softrdma RoCEv2 busy-poll WRITE 65536\", \"libfabric tcp rate\")")
    if not in_namespace():
        install()
    isolate()
    # samples[(stack, row)][round] = value
    samples, failures = {}, []
    for r in range(a.rounds):
        log(f"round {r + 1} of {a.rounds}: {sum(map(len, todo))} measurements")
        for grp in todo:
            # Every other round runs a group backwards: a pace that drifts
            # within the group weighs on both sides of its ratios alike.
            for stack, label, fn in (grp if r % 2 == 0 else grp[::-1]):
                try:
                    for row, val in fn().items():
                        samples.setdefault((stack, row), {})[r] = val
                except (Failed, subprocess.CalledProcessError) as e:
                    failures.append(f"round {r + 1}, {stack} {label}: {str(e).splitlines()[0]}")
                    log(f"FAILED {stack} {label}: {e}")
    text, med = report(samples, a.rounds, failures)
    print(text)
    if a.samples:
        rows = [{"stack": st, "figure": row, "rounds": {str(r + 1): v for r, v in vals.items()}}
                for (st, row), vals in samples.items()]
        a.samples.write_text(json.dumps(rows, indent=1) + "\n")
        log(f"wrote {a.samples}")
    if a.write_docs:
        (REPO / "docs/compare.md").write_text(text)
        (REPO / "docs/compare.svg").write_text(svg(med))
        log("wrote docs/compare.md and docs/compare.svg")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
