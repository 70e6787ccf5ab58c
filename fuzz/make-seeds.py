#!/usr/bin/env python3
"""Writes fuzz/seeds/TARGET/ from the golden captures in tests/data/: real rxe
packets and siw FPDUs make the fuzzers start from valid inputs."""
import hashlib
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "tests", "data")
OUT = os.path.join(HERE, "seeds")


def frames(path):
    with open(path, "rb") as f:
        d = f.read()
    off = 24
    while off + 16 <= len(d):
        incl = struct.unpack("<I", d[off + 8:off + 12])[0]
        yield d[off + 16:off + 16 + incl]
        off += 16 + incl


def put(target, data):
    os.makedirs(os.path.join(OUT, target), exist_ok=True)
    name = hashlib.sha1(data).hexdigest()[:16]
    with open(os.path.join(OUT, target, name), "wb") as f:
        f.write(data)


def pcapng(path, big):
    """The capture's first frames as pcapng: section header, one Ethernet
    interface, an enhanced packet block per frame."""
    e = ">" if big else "<"

    def block(kind, body):
        body += bytes(-len(body) % 4)
        n = 12 + len(body)
        return struct.pack(e + "II", kind, n) + body + struct.pack(e + "I", n)
    out = block(0x0A0D0D0A, struct.pack(e + "IHHq", 0x1A2B3C4D, 1, 0, -1))
    out += block(1, struct.pack(e + "HHI", 1, 0, 65535))
    for k, fr in enumerate(frames(path)):
        if k == 6:
            break
        out += block(6, struct.pack(e + "IIIII", 0, 0, k, len(fr), len(fr)) + fr)
    return out


def main():
    for name in sorted(os.listdir(DATA)):
        if not name.endswith(".pcap"):
            continue
        path = os.path.join(DATA, name)
        with open(path, "rb") as f:
            whole = f.read()
        if len(whole) < 40000:
            put("capture", whole)
        for big in (False, True):
            put("capture", pcapng(path, big))
        streams = {}
        for fr in frames(path):
            etype = struct.unpack(">H", fr[12:14])[0]
            if etype == 0x0800:
                ip = fr[14:34]
                l4 = fr[14 + (fr[14] & 15) * 4:14 + struct.unpack(">H", fr[16:18])[0]]
                proto = ip[9]
            elif etype == 0x86DD:
                ip = fr[14:54]
                l4 = fr[54:54 + struct.unpack(">H", fr[18:20])[0]]
                proto = ip[6]
            else:
                continue
            if proto == 17 and len(l4) > 8 and l4[2:4] == b"\x12\xb7":
                ib = l4[8:]
                for t in ("roce_packet", "bth", "aeth"):
                    put(t, ib[:64])
                put("aeth", ib[12:48])
                put("mad", ib[20:64])
                if ib[4:8] == b"\x00\x00\x00\x01" and len(ib) >= 280:
                    put("cm_mad", ib[20:276])
                put("icrc", bytes([len(ip)]) + ip + l4[:8] + ib[:80])
                put("rc_responder", bytes([0x3e]) + struct.pack("<H", len(ib)) + ib)
                if ib[0] >> 5 == 3:  # UD
                    put("ud_qp", bytes([0x4e]) + struct.pack("<H", len(ib)) + ib)
            elif proto == 6:
                doff = (l4[12] >> 4) * 4
                key = (ip[12:16], l4[0:2], ip[16:20], l4[2:4])
                streams.setdefault(key, b"")
                streams[key] += l4[doff:]
        for data in streams.values():
            if not data.startswith(b"MPA ID Re"):
                continue
            pd = struct.unpack(">H", data[18:20])[0]
            put("mpa_start_frame", data[:20 + pd])
            pos = 20 + pd
            n = 0
            # iwarp_qp: the stream's segments as the provider hands them over
            # (flags: CRC held, send after each, patch toward the region).
            segments = b""
            while pos + 2 <= len(data) and n < 8:
                ulen = struct.unpack(">H", data[pos:pos + 2])[0]
                total = 2 + ulen + (-(2 + ulen)) % 4 + 4
                fpdu = data[pos:pos + total]
                put("mpa_fpdu", fpdu[:256])
                put("mpa_unmark", b"\x00\x00" + fpdu[:256])
                put("ddp", fpdu[2:2 + ulen][:64])
                put("rdmap_message", fpdu[2:2 + ulen][:128])
                ulpdu = fpdu[2:2 + ulen]
                if ulpdu:
                    hlen = 14 if ulpdu[0] & 0x80 else 18
                    payload = ulpdu[hlen:][:512]
                    segments += bytes([0x07]) + struct.pack("<H", len(payload))
                    segments += ulpdu[:hlen] + payload
                pos += total
                n += 1
            if segments:
                put("iwarp_qp", bytes([0xfe]) + segments)
    # rc_responder: a WRITE ONLY, a READ request and a FETCH_ADD at the
    # region's key (control byte 0x01: key and address patched, no access
    # granted), which the QP must refuse without touching memory.
    bth = lambda op: bytes([op, 0, 0xff, 0xff, 0, 0, 0, 0x11, 0x80, 0, 0, 0])
    write = bth(0x0a) + struct.pack(">QII", 20480, 0x200, 16) + b"\xaa" * 16 + bytes(4)
    read = bth(0x0c) + struct.pack(">QII", 20480, 0x200, 64) + bytes(4)
    fadd = bth(0x14) + struct.pack(">QIQQ", 20480, 0x200, 1, 0) + bytes(4)
    for ctl in (0x01, 0x0f):
        put("rc_responder", bytes([ctl]) + b"".join(struct.pack("<H", len(p)) + p
                                                     for p in (write, read, fadd)))
    # Terminates in both layouts (siw's invalid-QN one, and the RFC's).
    put("rdmap_terminate", bytes([0x21, 0x01, 0x03, 0x00, 0x00, 0x10]) + bytes([0x41, 0x43] + [0] * 16))
    put("rdmap_terminate", bytes([0x12, 0x01, 0xc0, 0x00, 0x00, 0x10]) + bytes([0xc1, 0x40] + [0] * 12))
    put("grh", bytes(20) + bytes.fromhex("450000304c3640004011d9bc0a6300020a630003"))
    put("grh", bytes.fromhex("60000000001c1140") + bytes(range(32)))
    print(f"seeds in {OUT}:", {t: len(os.listdir(os.path.join(OUT, t))) for t in sorted(os.listdir(OUT))})


if __name__ == "__main__":
    sys.exit(main())
