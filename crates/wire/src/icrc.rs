//! The RoCEv2 invariant CRC (IBTA annex A17.4.1; rxe_icrc.c).
//!
//! CRC-32 (the Ethernet/zlib one) over: eight 0xFF bytes standing in for the
//! InfiniBand LRH; the IP header with the fields that routers change masked to
//! ones (IPv4: TOS, TTL, header checksum; IPv6: traffic class, flow label, hop
//! limit); the UDP header with its checksum masked; the BTH with byte 4 (FECN,
//! BECN, reserved) masked; and everything after the BTH up to the ICRC. The
//! result travels least significant byte first.
//!
//! The IPv4 identification and flags are *not* masked: a sender must know the ID
//! the kernel will write (Linux writes 0 for an unconnected UDP socket with DF set).

use crate::bytes::{check, get_u16};
use crate::{Error, Result, bth};

/// Length of the ICRC trailer.
pub const LEN: usize = 4;

const IPV4_HEADER_LEN: usize = 20;
const IPV6_HEADER_LEN: usize = 40;
const UDP_HEADER_LEN: usize = 8;

/// An ICRC being computed over a packet in pieces (so a sender can gather
/// headers and payload from different buffers without copying them together).
#[derive(Debug, Clone)]
pub struct Icrc {
    /// The reflected CRC-32 register (the complement of the running CRC).
    register: u32,
}

/// Room for the masked headers hashed in one piece: the LRH stand-in, an IPv6
/// header, UDP, and up to 72 bytes of InfiniBand headers (BTH and extension
/// headers: 12 + 16 RETH, or 12 + 28 AtomicETH, fit).
const HEADER_ROOM: usize = 8 + IPV6_HEADER_LEN + UDP_HEADER_LEN + 72;

impl Icrc {
    /// Starts an ICRC from the IP header (IPv4 without options, or IPv6) and the
    /// UDP header of the packet, as they are or will be on the wire.
    pub fn new(ip_header: &[u8], udp_header: &[u8]) -> Result<Icrc> {
        Icrc::with_ib_headers(ip_header, udp_header, &[])
    }

    /// [`Icrc::new`] followed by `ib_headers`: empty, or a whole BTH (masked
    /// as [`Icrc::update_bth`] does) and what follows it. Headers of a usual
    /// size are hashed in one piece, which costs much less than several
    /// small ones.
    pub fn with_ib_headers(ip_header: &[u8], udp_header: &[u8], ib_headers: &[u8]) -> Result<Icrc> {
        if !ib_headers.is_empty() {
            check("BTH", ib_headers, bth::HEADER_LEN)?;
        }
        let mut buf = [0u8; HEADER_ROOM];
        buf[..8].fill(0xff);
        let mut at = 8;
        check("IP header", ip_header, 1)?;
        match ip_header[0] >> 4 {
            4 => {
                check("IPv4 header", ip_header, IPV4_HEADER_LEN)?;
                if ip_header[0] & 0x0f != 5 {
                    return Err(Error::InvalidField {
                        field: "IPv4 header length (options are not allowed on RoCEv2)",
                        value: u64::from(ip_header[0] & 0x0f),
                    });
                }
                let ip = &mut buf[at..at + IPV4_HEADER_LEN];
                ip.copy_from_slice(&ip_header[..IPV4_HEADER_LEN]);
                ip[1] = 0xff; // TOS
                ip[8] = 0xff; // TTL
                ip[10] = 0xff; // header checksum
                ip[11] = 0xff;
                at += IPV4_HEADER_LEN;
            }
            6 => {
                check("IPv6 header", ip_header, IPV6_HEADER_LEN)?;
                let ip = &mut buf[at..at + IPV6_HEADER_LEN];
                ip.copy_from_slice(&ip_header[..IPV6_HEADER_LEN]);
                ip[0] |= 0x0f; // traffic class, high nibble
                ip[1] = 0xff; // traffic class, low nibble, and flow label
                ip[2] = 0xff;
                ip[3] = 0xff;
                ip[7] = 0xff; // hop limit
                at += IPV6_HEADER_LEN;
            }
            v => {
                return Err(Error::UnsupportedVersion {
                    field: "IP version",
                    value: v,
                });
            }
        }
        check("UDP header", udp_header, UDP_HEADER_LEN)?;
        let udp = &mut buf[at..at + UDP_HEADER_LEN];
        udp.copy_from_slice(&udp_header[..UDP_HEADER_LEN]);
        udp[6] = 0xff; // checksum
        udp[7] = 0xff;
        at += UDP_HEADER_LEN;
        let bth_at = at;
        // At least 72 bytes of room: the BTH is always inline.
        let inline = ib_headers.len().min(HEADER_ROOM - at);
        buf[at..at + inline].copy_from_slice(&ib_headers[..inline]);
        at += inline;
        if inline > 0 {
            buf[bth_at + 4] = 0xff; // BTH byte 4: FECN, BECN, reserved
        }
        let mut icrc = Icrc {
            register: crc_register_update(!0, &buf[..at]),
        };
        icrc.update(&ib_headers[inline..]);
        Ok(icrc)
    }

    /// Adds the BTH, masking its byte 4.
    pub fn update_bth(&mut self, bth_bytes: &[u8; bth::HEADER_LEN]) {
        let mut b = *bth_bytes;
        b[4] = 0xff;
        self.update(&b);
    }

    /// Adds bytes after the BTH: extension headers, payload, pad.
    pub fn update(&mut self, bytes: &[u8]) {
        self.register = crc_register_update(self.register, bytes);
    }

    /// The ICRC value; put it on the wire with `to_le_bytes`.
    pub fn finish(self) -> u32 {
        !self.register
    }
}

/// On x86-64, from this many bytes on crc32fast hashes them (its
/// carry-less fold, quicker than the tables: docs/performance.md,
/// thirty-eighth session); below, [`CRC_SLICES`], which spare a short piece
/// (an ACK's tail after the BTH's first word, a small payload) crc32fast's
/// hasher, feature check and call. Elsewhere crc32fast takes every length
/// (with aarch64's CRC instructions, say).
const FOLDING_FROM: usize = 16;

/// The reflected CRC-32 register `register` after `bytes`: eight bytes a
/// step through [`CRC_SLICES`], then four, then one at a time.
fn crc_register_update(register: u32, bytes: &[u8]) -> u32 {
    if cfg!(not(target_arch = "x86_64")) || bytes.len() >= FOLDING_FROM {
        // crc32fast keeps the CRC, the complement of the register.
        let mut h = crc32fast::Hasher::new_with_initial(!register);
        h.update(bytes);
        return !h.finalize();
    }
    let mut r = register;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let mut word = [0u8; 8];
        word.copy_from_slice(w);
        r = crc_word_step(u64::from_le_bytes(word) ^ u64::from(r));
    }
    let mut rest = words.remainder();
    // Packets are whole 4-byte words: their last one in one step.
    if let Some((half, tail)) = rest.split_first_chunk::<4>() {
        let x = u32::from_le_bytes(*half) ^ r;
        let t = &CRC_SLICES;
        r = t[3][usize::from(x as u8)]
            ^ t[2][usize::from((x >> 8) as u8)]
            ^ t[1][usize::from((x >> 16) as u8)]
            ^ t[0][usize::from((x >> 24) as u8)];
        rest = tail;
    }
    for &b in rest {
        r = CRC_SLICES[0][usize::from(r as u8 ^ b)] ^ (r >> 8);
    }
    r
}

/// The register after eight bytes, given as a little-endian word already
/// XORed with the register before them.
fn crc_word_step(w: u64) -> u32 {
    let t = &CRC_SLICES;
    let byte = |k: u32| usize::from((w >> (8 * k)) as u8);
    t[7][byte(0)]
        ^ t[6][byte(1)]
        ^ t[5][byte(2)]
        ^ t[4][byte(3)]
        ^ t[3][byte(4)]
        ^ t[2][byte(5)]
        ^ t[1][byte(6)]
        ^ t[0][byte(7)]
}

/// Slice-by-8 tables: row k holds what a byte followed by k zero bytes
/// leaves in the register.
static CRC_SLICES: [[u32; 256]; 8] = crc_slices();

const fn crc_slices() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    t[0] = crc_table();
    let mut k = 1;
    while k < 8 {
        let mut b = 0;
        while b < 256 {
            t[k][b] = crc_byte_step(t[k - 1][b], &t[0]);
            b += 1;
        }
        k += 1;
    }
    t
}

/// The ICRC of `ib`, an InfiniBand packet from the BTH to the end of the pad
/// (without the ICRC), carried in the given IP and UDP headers.
pub fn compute(ip_header: &[u8], udp_header: &[u8], ib: &[u8]) -> Result<u32> {
    check("BTH", ib, bth::HEADER_LEN)?;
    // The headers through the BTH in one piece, the rest in one more (which
    // then starts where the packet's 4-byte alignment does).
    let mut icrc = Icrc::with_ib_headers(ip_header, udp_header, &ib[..bth::HEADER_LEN])?;
    icrc.update(&ib[bth::HEADER_LEN..]);
    Ok(icrc.finish())
}

/// The ICRC carried in the last four bytes of `ib_with_icrc`.
pub fn carried(ib_with_icrc: &[u8]) -> Result<u32> {
    check("ICRC", ib_with_icrc, LEN)?;
    let n = ib_with_icrc.len();
    let mut v = [0u8; LEN];
    v.copy_from_slice(&ib_with_icrc[n - LEN..]);
    Ok(u32::from_le_bytes(v))
}

/// Checks the ICRC at the end of `ib_with_icrc` (BTH through ICRC).
pub fn verify(ip_header: &[u8], udp_header: &[u8], ib_with_icrc: &[u8]) -> Result<()> {
    check("packet with ICRC", ib_with_icrc, bth::HEADER_LEN + LEN)?;
    let carried = carried(ib_with_icrc)?;
    let computed = compute(
        ip_header,
        udp_header,
        &ib_with_icrc[..ib_with_icrc.len() - LEN],
    )?;
    if carried == computed {
        Ok(())
    } else {
        Err(Error::BadIcrc { computed, carried })
    }
}

/// Writes the ICRC into the last four bytes of `ib_with_icrc`.
pub fn fill(ip_header: &[u8], udp_header: &[u8], ib_with_icrc: &mut [u8]) -> Result<u32> {
    check("packet with ICRC", ib_with_icrc, bth::HEADER_LEN + LEN)?;
    let n = ib_with_icrc.len();
    let crc = compute(ip_header, udp_header, &ib_with_icrc[..n - LEN])?;
    ib_with_icrc[n - LEN..].copy_from_slice(&crc.to_le_bytes());
    Ok(crc)
}

/// The IPv4 Identification under which the packet's ICRC is right, for a
/// receiver that cannot see the real one (a UDP socket does not report it, and
/// Linux rxe sends a counting ID). `Ok(None)` when no ID makes the ICRC right:
/// the packet is corrupt. The identification in `ip_header` is ignored.
///
/// The CRC is affine over GF(2), so the carried ICRC differs from the one
/// computed with ID 0 by a linear function of the 16 ID bits; since CRC-32
/// detects every burst of up to 32 bits, that function is one-to-one, and
/// [`solve_identification`] inverts it. A corrupted packet still gets
/// through with probability 2^-16 (against 2^-32 when the ID is known).
pub fn solve_ipv4_identification(
    ip_header: &[u8],
    udp_header: &[u8],
    ib_with_icrc: &[u8],
) -> Result<Option<u16>> {
    check("IPv4 header", ip_header, IPV4_HEADER_LEN)?;
    check("packet with ICRC", ib_with_icrc, bth::HEADER_LEN + LEN)?;
    if ip_header[0] >> 4 != 4 {
        return Err(Error::UnsupportedVersion {
            field: "IP version",
            value: ip_header[0] >> 4,
        });
    }
    let mut ip = [0u8; IPV4_HEADER_LEN];
    ip.copy_from_slice(&ip_header[..IPV4_HEADER_LEN]);
    ip[4] = 0;
    ip[5] = 0;
    let body = &ib_with_icrc[..ib_with_icrc.len() - LEN];
    let delta = carried(ib_with_icrc)? ^ compute(&ip, udp_header, body)?;
    Ok(solve_identification(ib_with_icrc.len(), delta))
}

/// The IP ID behind `syndrome` ([`Ipv4Flow::syndrome`]) of a packet of
/// `packet_len` bytes (BTH through ICRC), without a per-length map: `None`
/// when no ID explains it (the packet is corrupt). Lengths past the table
/// below (beyond any path MTU) take an [`IdentificationMap`].
///
/// The ID bits, read as a polynomial m(x) of degree below 16, leave the
/// CRC register differing by m(x)·x^32 mod P when hashed, and each of the
/// `t` bytes after them multiplies that by x^8. So the syndrome times
/// x^-(8t + 32) mod P is m(x) itself: one multiplication by a tabled
/// constant, where a map for a new length takes 0.3–0.7 µs to make.
pub fn solve_identification(packet_len: usize, syndrome: u32) -> Option<u16> {
    let trailing = id_trailing_bytes(packet_len);
    let Some(&unshift) = UNSHIFT.get(trailing) else {
        return IdentificationMap::new(packet_len).solve(syndrome);
    };
    let m = mul_mod(unshift, syndrome);
    // In the reflected register x^k is bit 31 - k: the ID's low byte (the
    // last hashed) lands in bits 24..32, its high byte in 16..24, and
    // nothing may be left below.
    (m & 0xffff == 0).then_some(((m >> 24) | (m >> 8 & 0xff00)) as u16)
}

/// Bytes hashed after the IPv4 ID for a packet of `packet_len` bytes (BTH
/// through ICRC): the rest of the prefix and the packet without its ICRC.
const fn id_trailing_bytes(packet_len: usize) -> usize {
    IPV4_PREFIX_LEN - IP_ID_AT - 2 + packet_len.saturating_sub(LEN)
}

/// a(x)·b(x) mod P, both reflected (bit 31 is x^0): b times x (a bit step)
/// for each bit of a, as zlib's crc32_combine multiplies, in four chains
/// of eight that run side by side (b, b·x^8, b·x^16, b·x^24).
fn mul_mod(a: u32, b: u32) -> u32 {
    let table = &CRC_SLICES[0];
    let b8 = crc_byte_step(b, table);
    let b16 = crc_byte_step(b8, table);
    let b24 = crc_byte_step(b16, table);
    // `bits`: eight coefficients of a, x^0's at bit 7.
    let times = |bits: u32, mut c: u32| {
        let mut p = 0;
        for i in (0..8).rev() {
            p ^= c & 0u32.wrapping_sub(bits >> i & 1);
            c = crc_bit_step(c);
        }
        p
    };
    times(a >> 24, b) ^ times(a >> 16 & 0xff, b8) ^ times(a >> 8 & 0xff, b16) ^ times(a & 0xff, b24)
}

/// One zero byte backwards: the register `e` came from, so that
/// `unshift_byte(crc_byte_step(d)) == d`. The table's top bytes are all
/// different, so `e`'s top byte names the entry that was XORed in.
const fn unshift_byte(e: u32, table: &[u32; 256], entry_of_top: &[u8; 256]) -> u32 {
    let i = entry_of_top[(e >> 24) as usize];
    ((e ^ table[i as usize]) << 8) | i as u32
}

/// Packets up to this many bytes (BTH through ICRC) solve by [`UNSHIFT`]:
/// a 4096-byte path MTU's largest with room to spare.
const UNSHIFT_PACKET_MAX: usize = 4096 + 256;

/// x^-(8t + 32) mod P, reflected, for `t` bytes hashed after the ID.
static UNSHIFT: [u32; id_trailing_bytes(UNSHIFT_PACKET_MAX) + 1] = unshift_table();

const fn unshift_table<const N: usize>() -> [u32; N] {
    let table = crc_table();
    let mut entry_of_top = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        entry_of_top[(table[i] >> 24) as usize] = i as u8;
        i += 1;
    }
    // x^0, then x^-32: four bytes back.
    let mut c = 1u32 << 31;
    let mut k = 0;
    while k < 4 {
        c = unshift_byte(c, &table, &entry_of_top);
        k += 1;
    }
    let mut out = [0u32; N];
    let mut t = 0;
    while t < N {
        out[t] = c;
        c = unshift_byte(c, &table, &entry_of_top);
        t += 1;
    }
    out
}

/// What the IPv4 Identification does to the ICRC of packets of one length
/// (BTH through ICRC): the ICRC under ID `x` is the one under ID 0 XOR a
/// linear function of `x`'s 16 bits. Made once per length, it finds a
/// packet's ID from one pass over the packet (see [`Ipv4Flow::syndrome`]).
///
/// Since CRC-32 detects every burst of up to 32 bits, the function is
/// one-to-one; a corrupted packet still solves to some ID with probability
/// 2^-16 (against 2^-32 when the ID is known).
#[derive(Debug, Clone)]
pub struct IdentificationMap {
    packet_len: usize,
    /// What flipping ID bit b XORs into the ICRC.
    columns: [u32; 16],
    /// The columns in reduced echelon form: the vector with pivot bit p
    /// (its highest; no other vector has it) and the ID bits making it.
    basis: [(u32, u16); 32],
    /// The pivot bits.
    pivots: u32,
}

/// One bit of the reflected CRC-32 register with a zero input bit: the
/// difference two messages' registers carry over one more bit.
const fn crc_bit_step(d: u32) -> u32 {
    if d & 1 != 0 {
        (d >> 1) ^ 0xEDB8_8320
    } else {
        d >> 1
    }
}

/// One zero byte through the reflected CRC-32 register (`table` from
/// [`crc_table`]): the register times x^8 mod P.
const fn crc_byte_step(c: u32, table: &[u32; 256]) -> u32 {
    table[(c & 0xff) as usize] ^ (c >> 8)
}

impl IdentificationMap {
    /// The map for packets of `packet_len` bytes, BTH through ICRC.
    pub fn new(packet_len: usize) -> IdentificationMap {
        // A difference in the last bit of the ID's low byte leaves the
        // register differing by the polynomial; then the bytes after the ID
        // (the rest of the prefix, the packet without its ICRC) carry it on.
        let trailing = id_trailing_bytes(packet_len);
        let mut d = 0xEDB8_8320u32;
        let zeros = [0u8; 256];
        let mut left = trailing;
        while left > 0 {
            // crc32fast's register is the complement of its state; zero
            // input bytes move a difference linearly.
            let n = left.min(zeros.len());
            let mut h = crc32fast::Hasher::new_with_initial(!d);
            h.update(&zeros[..n]);
            d = !h.finalize();
            left -= n;
        }
        // Bits are hashed least significant first: ID bit 7 (the low byte's
        // top bit) goes last, bit 0 eight bits before it, and the high
        // byte's bit 15 one bit before bit 0.
        let mut columns = [0u32; 16];
        for b in (0..8).rev().chain((8..16).rev()) {
            columns[b] = d;
            d = crc_bit_step(d);
        }
        // Echelon form by highest bit, with the ID bits making each vector.
        let mut basis = [(0u32, 0u16); 32];
        for (b, &col) in columns.iter().enumerate() {
            let (mut v, mut m) = (col, 1u16 << b);
            while v != 0 {
                let p = 31 - v.leading_zeros() as usize;
                if basis[p].0 == 0 {
                    basis[p] = (v, m);
                    break;
                }
                v ^= basis[p].0;
                m ^= basis[p].1;
            }
        }
        // Reduced: each pivot bit cleared from the vectors above it (from
        // the highest pivot down, which sets only lower bits).
        for p in (0..32).rev() {
            let (v, m) = basis[p];
            if v == 0 {
                continue;
            }
            for above in basis.iter_mut().skip(p + 1) {
                if above.0 >> p & 1 != 0 {
                    above.0 ^= v;
                    above.1 ^= m;
                }
            }
        }
        let pivots = (0..32)
            .filter(|&p| basis[p].0 != 0)
            .fold(0u32, |bits, p| bits | 1 << p);
        IdentificationMap {
            packet_len,
            columns,
            basis,
            pivots,
        }
    }

    /// The packet length (BTH through ICRC) the map is for.
    pub fn packet_len(&self) -> usize {
        self.packet_len
    }

    /// What ID `id` XORs into the ICRC, against ID 0.
    pub fn delta(&self, id: u16) -> u32 {
        let mut d = 0;
        let mut bits = id;
        while bits != 0 {
            d ^= self.columns[bits.trailing_zeros() as usize];
            bits &= bits - 1;
        }
        d
    }

    /// The ID whose [`delta`](IdentificationMap::delta) is `delta`, if any:
    /// in the reduced form a difference in the map is the sum of the
    /// vectors of its pivot bits.
    pub fn solve(&self, delta: u32) -> Option<u16> {
        let (mut id, mut sum) = (0u16, 0u32);
        let mut bits = delta & self.pivots;
        while bits != 0 {
            let (v, m) = self.basis[bits.trailing_zeros() as usize];
            sum ^= v;
            id ^= m;
            bits &= bits - 1;
        }
        (sum == delta).then_some(id)
    }
}

/// The [`IdentificationMap`]s of some packet lengths a receiver met (a
/// stream has a few: full packets, a message's last, ACKs), and the ID of
/// a packet found with them. A length without a map solves by
/// [`solve_identification`] (about three times a map's solve); maps are
/// made (each costing some 10–20 such solves) for the first eight lengths
/// met, and after that, in turn, for the length of every 64th miss, so
/// that packets of many lengths cost no map each.
#[derive(Debug, Clone, Default)]
pub struct IdentificationMaps {
    maps: Vec<Kept>,
    next: usize,
    misses: u32,
}

/// A kept map, with the ID it found last and the step from the one before:
/// packets of one length from one sender mostly count up by the same step
/// (a GSO send's segments take consecutive IDs, and a ping-pong's WRITEs
/// and ACKs alternate), so the next ID is tried first, for a few XORs
/// instead of a solve. The answer is the solve's either way: an ID's
/// syndrome is its alone.
#[derive(Debug, Clone)]
struct Kept {
    map: IdentificationMap,
    /// The ID found last and its syndrome.
    last: Option<(u16, u32)>,
    step: u16,
    /// IDs found by the guess.
    #[cfg(test)]
    guessed: u32,
}

impl Kept {
    fn new(map: IdentificationMap) -> Kept {
        Kept {
            map,
            last: None,
            step: 1,
            #[cfg(test)]
            guessed: 0,
        }
    }

    fn solve(&mut self, syndrome: u32) -> Option<u16> {
        let id = match self.last {
            Some((last, last_syndrome)) => {
                let guess = last.wrapping_add(self.step);
                // The syndrome is linear in the ID: the guess's differs
                // from the last's by that of the bits they differ in.
                if last_syndrome ^ self.map.delta(last ^ guess) == syndrome {
                    #[cfg(test)]
                    {
                        self.guessed += 1;
                    }
                    guess
                } else {
                    let id = self.map.solve(syndrome)?;
                    self.step = id.wrapping_sub(last);
                    id
                }
            }
            None => self.map.solve(syndrome)?,
        };
        self.last = Some((id, syndrome));
        Some(id)
    }
}

impl IdentificationMaps {
    const KEPT: usize = 8;
    /// Misses, once all maps are made, per map made again.
    const MISSES_PER_MAP: u32 = 64;

    /// None yet.
    pub const fn new() -> IdentificationMaps {
        IdentificationMaps {
            maps: Vec::new(),
            next: 0,
            misses: 0,
        }
    }

    /// The lengths with a map, in no order.
    #[cfg(test)]
    fn lengths(&self) -> impl Iterator<Item = usize> + '_ {
        self.maps.iter().map(|k| k.map.packet_len())
    }

    /// The ID behind `syndrome` of a packet of `packet_len` bytes (BTH
    /// through ICRC), by its length's map if kept.
    pub fn solve(&mut self, packet_len: usize, syndrome: u32) -> Option<u16> {
        if let Some(k) = self
            .maps
            .iter_mut()
            .find(|k| k.map.packet_len() == packet_len)
        {
            return k.solve(syndrome);
        }
        let slot = if self.maps.len() < Self::KEPT {
            self.maps
                .push(Kept::new(IdentificationMap::new(packet_len)));
            self.maps.len() - 1
        } else {
            self.misses += 1;
            if self.misses < Self::MISSES_PER_MAP {
                return solve_identification(packet_len, syndrome);
            }
            self.misses = 0;
            self.next = (self.next + 1) % Self::KEPT;
            self.maps[self.next] = Kept::new(IdentificationMap::new(packet_len));
            self.next
        };
        self.maps[slot].solve(syndrome)
    }

    /// The IP ID `ib_with_icrc` (BTH through ICRC), a packet of `flow`,
    /// came under: `None` if no ID makes its ICRC right. One pass over the
    /// packet.
    pub fn identify(&mut self, flow: &Ipv4Flow, ib_with_icrc: &[u8]) -> Option<u16> {
        match flow.syndrome(ib_with_icrc) {
            Ok(0) => Some(0),
            Ok(syndrome) => self.solve(ib_with_icrc.len(), syndrome),
            Err(_) => None,
        }
    }
}

/// The IPv4 header a kernel will put in front of a RoCEv2 datagram, as far as
/// the ICRC sees it (the masked fields are left zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Pseudo {
    /// Source address.
    pub src: [u8; 4],
    /// Destination address.
    pub dst: [u8; 4],
    /// Identification field (0 from an unconnected Linux UDP socket with DF).
    pub identification: u16,
    /// Don't-fragment flag.
    pub dont_fragment: bool,
}

impl Ipv4Pseudo {
    /// The header of a datagram from `src` to `dst` with DF set, as RoCEv2
    /// goes over Linux (rxe's and softrdma's sockets do path MTU discovery),
    /// with ID 0: each packet gives its own.
    pub const fn df(src: core::net::Ipv4Addr, dst: core::net::Ipv4Addr) -> Ipv4Pseudo {
        Ipv4Pseudo {
            src: src.octets(),
            dst: dst.octets(),
            identification: 0,
            dont_fragment: true,
        }
    }

    /// The 20 header bytes for a UDP datagram of `udp_len` bytes (header included).
    pub fn header(&self, udp_len: u16) -> [u8; IPV4_HEADER_LEN] {
        let mut h = [0u8; IPV4_HEADER_LEN];
        h[0] = 0x45;
        h[2..4].copy_from_slice(&(udp_len.wrapping_add(IPV4_HEADER_LEN as u16)).to_be_bytes());
        h[4..6].copy_from_slice(&self.identification.to_be_bytes());
        h[6] = if self.dont_fragment { 0x40 } else { 0 };
        h[9] = 17; // UDP
        h[12..16].copy_from_slice(&self.src);
        h[16..20].copy_from_slice(&self.dst);
        h
    }
}

/// The reflected CRC-32 table (polynomial 0xEDB88320).
const fn crc_table() -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut b = 0;
    while b < 256 {
        let mut c = b as u32;
        let mut k = 0;
        while k < 8 {
            c = crc_bit_step(c);
            k += 1;
        }
        t[b] = c;
        b += 1;
    }
    t
}

/// Bytes of the ICRC's pseudo-header prefix before the BTH on IPv4: the LRH
/// stand-in, the IPv4 header, the UDP header.
const IPV4_PREFIX_LEN: usize = 8 + IPV4_HEADER_LEN + UDP_HEADER_LEN;

/// What a byte at `offset` of the IPv4 prefix adds to the CRC after the
/// prefix, for each of its values (the CRC is affine: changing bytes XORs
/// their contributions in).
const fn prefix_byte_table(offset: usize) -> [u32; 256] {
    let base = crc_table();
    let mut t = [0u32; 256];
    let mut b = 0;
    while b < 256 {
        let mut c = base[b];
        let mut zeros = IPV4_PREFIX_LEN - 1 - offset;
        while zeros > 0 {
            c = crc_byte_step(c, &base);
            zeros -= 1;
        }
        t[b] = c;
        b += 1;
    }
    t
}

/// The prefix bytes that change from packet to packet of one flow: the IPv4
/// total length, the IPv4 identification and the UDP length, most
/// significant byte first.
const IP_TOTAL_LEN_AT: usize = 8 + 2;
const IP_ID_AT: usize = 8 + 4;
const UDP_LEN_AT: usize = 8 + IPV4_HEADER_LEN + 4;
static VARYING_BYTE_TABLES: [[u32; 256]; 6] = [
    prefix_byte_table(IP_TOTAL_LEN_AT),
    prefix_byte_table(IP_TOTAL_LEN_AT + 1),
    prefix_byte_table(IP_ID_AT),
    prefix_byte_table(IP_ID_AT + 1),
    prefix_byte_table(UDP_LEN_AT),
    prefix_byte_table(UDP_LEN_AT + 1),
];

/// One RoCEv2 flow over IPv4 (addresses, ports, DF), with the ICRC over its
/// pseudo-header prefix computed once: each packet then starts its ICRC
/// from six table lookups (for its length and IP ID) instead of hashing the
/// 36 prefix bytes again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Flow {
    /// The IP header's fixed part.
    pub ip: Ipv4Pseudo,
    /// UDP source port.
    pub src_port: u16,
    /// UDP destination port.
    pub dst_port: u16,
    /// The CRC of the prefix with length and ID fields zero.
    base: u32,
}

impl Ipv4Flow {
    /// The flow; `ip.identification` is ignored (each packet gives its own).
    pub fn new(ip: Ipv4Pseudo, src_port: u16, dst_port: u16) -> Ipv4Flow {
        let ip = Ipv4Pseudo {
            identification: 0,
            ..ip
        };
        // The prefix with the per-packet fields (lengths, ID) zero, masked
        // as every ICRC masks it.
        let mut h = ip.header(0);
        h[2..4].fill(0);
        let base = Icrc::new(&h, &udp_header(src_port, dst_port, 0))
            .expect("an IPv4 header without options")
            .finish();
        Ipv4Flow {
            ip,
            src_port,
            dst_port,
            base,
        }
    }

    /// Whether this is the flow of these addresses and ports.
    pub fn is(&self, ip: &Ipv4Pseudo, src_port: u16, dst_port: u16) -> bool {
        self.ip.src == ip.src
            && self.ip.dst == ip.dst
            && self.ip.dont_fragment == ip.dont_fragment
            && self.src_port == src_port
            && self.dst_port == dst_port
    }

    /// The CRC over the prefix of a datagram of `udp_len` bytes with IP ID
    /// `identification`.
    fn prefix_crc(&self, identification: u16, udp_len: u16) -> u32 {
        let total = udp_len.wrapping_add(IPV4_HEADER_LEN as u16).to_be_bytes();
        let id = identification.to_be_bytes();
        let ul = udp_len.to_be_bytes();
        let t = &VARYING_BYTE_TABLES;
        self.base
            ^ t[0][usize::from(total[0])]
            ^ t[1][usize::from(total[1])]
            ^ t[2][usize::from(id[0])]
            ^ t[3][usize::from(id[1])]
            ^ t[4][usize::from(ul[0])]
            ^ t[5][usize::from(ul[1])]
    }

    /// [`Icrc::with_ib_headers`] for a datagram of this flow of `udp_len`
    /// bytes with IP ID `identification`: `ib_headers` is a whole BTH and
    /// what follows it. The prefix comes from six table lookups and the
    /// BTH's first word is masked in a register: no bytes are copied.
    pub fn icrc(&self, identification: u16, udp_len: u16, ib_headers: &[u8]) -> Result<Icrc> {
        check("BTH", ib_headers, bth::HEADER_LEN)?;
        let (first, rest) = ib_headers.split_at(8);
        let mut word = [0u8; 8];
        word.copy_from_slice(first);
        // BTH byte 4 (FECN, BECN, reserved) masked.
        let word = u64::from_le_bytes(word) | 0xff << 32;
        let register = !self.prefix_crc(identification, udp_len);
        let mut icrc = Icrc {
            register: crc_word_step(word ^ u64::from(register)),
        };
        icrc.update(rest);
        Ok(icrc)
    }

    /// [`verify`] for a packet of this flow (BTH through ICRC) that came in
    /// a datagram with IP ID `identification`.
    pub fn verify(&self, identification: u16, ib_with_icrc: &[u8]) -> Result<()> {
        check("packet with ICRC", ib_with_icrc, bth::HEADER_LEN + LEN)?;
        let n = ib_with_icrc.len();
        let udp_len = u16::try_from(UDP_HEADER_LEN + n).map_err(|_| Error::InvalidField {
            field: "UDP length",
            value: (UDP_HEADER_LEN + n) as u64,
        })?;
        let computed = self
            .icrc(identification, udp_len, &ib_with_icrc[..n - LEN])?
            .finish();
        let carried = carried(ib_with_icrc)?;
        if carried == computed {
            Ok(())
        } else {
            Err(Error::BadIcrc { computed, carried })
        }
    }

    /// The ICRC a packet of this flow carries (BTH through ICRC) XOR the one
    /// it would carry under IP ID 0: 0 when it came under ID 0, else the
    /// [`IdentificationMap::delta`] of its ID, if it is intact.
    pub fn syndrome(&self, ib_with_icrc: &[u8]) -> Result<u32> {
        check("packet with ICRC", ib_with_icrc, bth::HEADER_LEN + LEN)?;
        let n = ib_with_icrc.len();
        let udp_len = u16::try_from(UDP_HEADER_LEN + n).map_err(|_| Error::InvalidField {
            field: "UDP length",
            value: (UDP_HEADER_LEN + n) as u64,
        })?;
        let computed = self.icrc(0, udp_len, &ib_with_icrc[..n - LEN])?.finish();
        Ok(carried(ib_with_icrc)? ^ computed)
    }
}

/// The IPv6 header in front of a RoCEv2 datagram, as the ICRC sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv6Pseudo {
    /// Source address.
    pub src: [u8; 16],
    /// Destination address.
    pub dst: [u8; 16],
}

impl Ipv6Pseudo {
    /// The 40 header bytes for a UDP datagram of `udp_len` bytes (header included).
    pub fn header(&self, udp_len: u16) -> [u8; IPV6_HEADER_LEN] {
        let mut h = [0u8; IPV6_HEADER_LEN];
        h[0] = 0x60;
        h[4..6].copy_from_slice(&udp_len.to_be_bytes());
        h[6] = 17; // UDP
        h[8..24].copy_from_slice(&self.src);
        h[24..40].copy_from_slice(&self.dst);
        h
    }
}

/// A UDP header of a RoCEv2 datagram of `udp_len` bytes (checksum 0; it is masked).
pub fn udp_header(src_port: u16, dst_port: u16, udp_len: u16) -> [u8; UDP_HEADER_LEN] {
    let mut h = [0u8; UDP_HEADER_LEN];
    h[0..2].copy_from_slice(&src_port.to_be_bytes());
    h[2..4].copy_from_slice(&dst_port.to_be_bytes());
    h[4..6].copy_from_slice(&udp_len.to_be_bytes());
    h
}

/// The UDP length field of a UDP header.
pub fn udp_len(udp_header: &[u8]) -> Result<u16> {
    check("UDP header", udp_header, UDP_HEADER_LEN)?;
    Ok(get_u16(udp_header, 4..6))
}

#[cfg(test)]
mod tests {
    use super::*;

    // rxe_write_bw.pcap frame 99, from the IP header on.
    const ACK_FRAME: [u8; 48] = [
        0x45, 0x00, 0x00, 0x30, 0x4c, 0x36, 0x40, 0x00, 0x40, 0x11, 0xd9, 0xbc, 0x0a, 0x63, 0x00,
        0x02, 0x0a, 0x63, 0x00, 0x03, // IPv4
        0xc1, 0x21, 0x12, 0xb7, 0x00, 0x1c, 0x00, 0x00, // UDP
        0x11, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x00, 0x03, 0x7d, 0x59, // BTH
        0x1f, 0x00, 0x00, 0x01, // AETH
        0xdd, 0x1f, 0x4b, 0xca, // ICRC
    ];

    #[test]
    fn golden_ipv4() {
        let (ip, rest) = ACK_FRAME.split_at(20);
        let (udp, ib) = rest.split_at(8);
        verify(ip, udp, ib).unwrap();
        assert_eq!(carried(ib).unwrap(), 0xca4b_1fdd);
        let mut copy = ib.to_vec();
        copy[44 - 28] ^= 1; // an AETH bit
        assert!(matches!(verify(ip, udp, &copy), Err(Error::BadIcrc { .. })));
    }

    #[test]
    fn masked_fields_do_not_matter() {
        let mut f = ACK_FRAME;
        f[1] = 0x2e; // TOS
        f[8] = 1; // TTL
        f[10] = 0; // IP checksum
        f[26] = 0x12; // UDP checksum
        f[28 + 4] = 0xc0; // FECN, BECN
        let (ip, rest) = f.split_at(20);
        let (udp, ib) = rest.split_at(8);
        verify(ip, udp, ib).unwrap();
        // The identification is covered.
        let mut g = ACK_FRAME;
        g[5] ^= 1;
        let (ip, rest) = g.split_at(20);
        let (udp, ib) = rest.split_at(8);
        assert!(verify(ip, udp, ib).is_err());
    }

    #[test]
    fn pseudo_header_matches_the_real_one() {
        // The captured rxe packet's header: DF, its ID; TOS, TTL and
        // checksum, which the ICRC masks, left out.
        let p = Ipv4Pseudo {
            identification: 0x4c36,
            ..Ipv4Pseudo::df([10, 99, 0, 2].into(), [10, 99, 0, 3].into())
        };
        let mut real = *ACK_FRAME[..20].first_chunk::<20>().unwrap();
        for masked in [1, 8, 10, 11] {
            real[masked] = 0;
        }
        assert_eq!(p.header(28), real);
        let udp = udp_header(49441, 4791, 28);
        let ib = &ACK_FRAME[28..44];
        assert_eq!(
            compute(&p.header(28), &udp, ib).unwrap(),
            carried(&ACK_FRAME[28..]).unwrap()
        );
        assert_eq!(udp_len(&udp).unwrap(), 28);
    }

    /// A flow with DF set from `src`, port `src_port`, to `dst`'s port 4791.
    fn flow_to_4791(src: [u8; 4], dst: [u8; 4], src_port: u16) -> Ipv4Flow {
        Ipv4Flow::new(Ipv4Pseudo::df(src.into(), dst.into()), src_port, 4791)
    }

    #[test]
    fn a_flow_verifies_a_captured_packet_and_catches_a_flipped_bit() {
        let flow = flow_to_4791([10, 99, 0, 2], [10, 99, 0, 3], 49441);
        let ib = &ACK_FRAME[28..];
        flow.verify(0x4c36, ib).unwrap();
        assert!(flow.verify(0x4c37, ib).is_err(), "the ID is covered");
        for bit in 0..ib.len() * 8 {
            let mut copy = ib.to_vec();
            copy[bit / 8] ^= 1 << (bit % 8);
            let masked = bit / 8 == 4; // BTH byte 4
            assert_eq!(flow.verify(0x4c36, &copy).is_ok(), masked, "bit {bit}");
        }
        assert!(flow.verify(0x4c36, &ib[..15]).is_err(), "too short");
    }

    #[test]
    fn a_flow_starts_the_icrc_as_the_whole_headers_do() {
        let mut body = [0u8; 200];
        for (i, b) in body.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37).wrapping_add(11);
        }
        let flows = [
            ([127, 0, 0, 91], [127, 0, 0, 92], 4791, 4791, true),
            ([10, 99, 0, 2], [192, 168, 200, 1], 49441, 4791, false),
            ([255; 4], [0; 4], 0xffff, 0, true),
        ];
        for (src, dst, sport, dport, df) in flows {
            let ip = Ipv4Pseudo {
                src,
                dst,
                identification: 0,
                dont_fragment: df,
            };
            let flow = Ipv4Flow::new(ip, sport, dport);
            assert!(flow.is(&ip, sport, dport));
            assert!(!flow.is(&ip, sport, dport ^ 1));
            for id in [0u16, 1, 14, 0x00ff, 0x1234, 0xff00, 0xffff] {
                for ib_len in [12usize, 16, 28, 40, 72, 73, 200] {
                    // Real datagrams and lengths no header set could carry.
                    for udp_len in [(8 + ib_len + 4) as u16, 20, 0x1018, 65507, 0xffff] {
                        let whole = Icrc::with_ib_headers(
                            &Ipv4Pseudo {
                                identification: id,
                                ..ip
                            }
                            .header(udp_len),
                            &udp_header(sport, dport, udp_len),
                            &body[..ib_len],
                        )
                        .unwrap()
                        .finish();
                        let fast = flow.icrc(id, udp_len, &body[..ib_len]).unwrap().finish();
                        assert_eq!(fast, whole, "{src:?} id {id} ib {ib_len} udp {udp_len}");
                    }
                }
            }
        }
        let flow = Ipv4Flow::new(
            Ipv4Pseudo {
                src: [1; 4],
                dst: [2; 4],
                identification: 9,
                dont_fragment: true,
            },
            1,
            2,
        );
        assert!(flow.icrc(0, 20, &body[..11]).is_err(), "shorter than a BTH");
    }

    #[test]
    fn pieces_equal_whole() {
        let (ip, rest) = ACK_FRAME.split_at(20);
        let (udp, ib) = rest.split_at(8);
        let mut i = Icrc::new(ip, udp).unwrap();
        i.update_bth(ib[..12].try_into().unwrap());
        i.update(&ib[12..14]);
        i.update(&ib[14..16]);
        assert_eq!(i.finish(), carried(ib).unwrap());
    }

    #[test]
    fn headers_in_one_piece_equal_headers_in_pieces() {
        let (ip, rest) = ACK_FRAME.split_at(20);
        let (udp, _) = rest.split_at(8);
        let ip6 = Ipv6Pseudo {
            src: [1; 16],
            dst: [2; 16],
        }
        .header(300);
        let ib: Vec<u8> = (0..200u32).map(|i| (i * 37 + 11) as u8).collect();
        for ip in [ip, &ip6[..]] {
            for n in [12, 13, 28, 40, 71, 72, 73, 100, 200] {
                // The annex's masking, spelled out byte by byte.
                let mut whole = vec![0xffu8; 8];
                let mut masked_ip = ip.to_vec();
                if ip.len() == 20 {
                    for i in [1, 8, 10, 11] {
                        masked_ip[i] = 0xff;
                    }
                } else {
                    masked_ip[0] |= 0x0f;
                    for i in [1, 2, 3, 7] {
                        masked_ip[i] = 0xff;
                    }
                }
                whole.extend_from_slice(&masked_ip);
                whole.extend_from_slice(&udp[..6]);
                whole.extend_from_slice(&[0xff, 0xff]);
                whole.extend_from_slice(&ib[..n]);
                whole[8 + ip.len() + 8 + 4] = 0xff;
                let one = Icrc::with_ib_headers(ip, udp, &ib[..n]).unwrap();
                assert_eq!(
                    one.finish(),
                    crc32fast::hash(&whole),
                    "{n} bytes of IB headers"
                );
            }
        }
    }

    #[test]
    fn the_register_update_is_crc32_at_every_length() {
        let bytes: Vec<u8> = (0..300u32).map(|i| (i * 151 + 7) as u8).collect();
        for start in [0u32, 0x1234_5678, !0] {
            for n in 0..bytes.len() {
                // Split so that words start off the input's alignment too.
                let (a, b) = bytes[..n].split_at(n / 3);
                let r = crc_register_update(crc_register_update(!start, a), b);
                let mut h = crc32fast::Hasher::new_with_initial(start);
                h.update(&bytes[..n]);
                assert_eq!(!r, h.finalize(), "{n} bytes from {start:#x}");
            }
        }
    }

    #[test]
    fn a_partial_bth_is_refused() {
        let (ip, rest) = ACK_FRAME.split_at(20);
        let (udp, ib) = rest.split_at(8);
        for n in 1..12 {
            assert!(
                Icrc::with_ib_headers(ip, udp, &ib[..n]).is_err(),
                "{n} bytes"
            );
        }
    }

    #[test]
    fn rejects() {
        let udp = [0u8; 8];
        assert!(matches!(
            Icrc::new(&[0x55; 20], &udp),
            Err(Error::UnsupportedVersion { value: 5, .. })
        ));
        assert!(Icrc::new(&[0x46; 24], &udp).is_err(), "IPv4 options");
        assert!(Icrc::new(&[0x45; 19], &udp).is_err());
        assert!(Icrc::new(&[0x60; 39], &udp).is_err());
        assert!(Icrc::new(&[0x45; 20], &udp[..7]).is_err());
        assert!(verify(&[0x45; 20], &udp, &[0u8; 15]).is_err());
        assert!(Icrc::new(&[], &udp).is_err());
    }

    #[test]
    fn solves_the_identification() {
        let (ip, rest) = ACK_FRAME.split_at(20);
        let (udp, ib) = rest.split_at(8);
        let mut blind = ip.to_vec();
        blind[4] = 0;
        blind[5] = 0;
        assert_eq!(
            solve_ipv4_identification(&blind, udp, ib).unwrap(),
            Some(0x4c36)
        );
        // A corrupted packet has no solution (or, 1 in 65536, a wrong one that
        // still checks out: not with this byte).
        let mut bad = ib.to_vec();
        bad[14] ^= 0x10;
        assert_eq!(solve_ipv4_identification(&blind, udp, &bad).unwrap(), None);
        assert!(solve_ipv4_identification(&[0x60; 40], udp, ib).is_err());
    }

    #[test]
    fn an_identification_map_finds_any_id_from_one_pass() {
        let flow = flow_to_4791([10, 0, 0, 1], [10, 0, 0, 2], 49152);
        for len in [bth::HEADER_LEN + LEN, 40, 301, 4096 + 28 + LEN, 9000] {
            let map = IdentificationMap::new(len);
            assert_eq!(map.packet_len(), len);
            let mut packet: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
            let udp_len = (UDP_HEADER_LEN + len) as u16;
            for id in [0u16, 1, 2, 3, 0x80, 0x100, 0x4c36, 0xffff, 0x8000] {
                let crc = flow
                    .icrc(id, udp_len, &packet[..len - LEN])
                    .unwrap()
                    .finish();
                packet[len - LEN..].copy_from_slice(&crc.to_le_bytes());
                flow.verify(id, &packet).unwrap();
                let syndrome = flow.syndrome(&packet).unwrap();
                assert_eq!(syndrome, map.delta(id), "len {len} id {id:#x}");
                assert_eq!(map.solve(syndrome), Some(id), "len {len} id {id:#x}");
            }
            // A flipped bit in the payload leaves no ID (1 in 65536 would).
            packet[13] ^= 4;
            assert_eq!(
                map.solve(flow.syndrome(&packet).unwrap()),
                None,
                "len {len}"
            );
        }
        assert!(flow.syndrome(&[0u8; 15]).is_err());
        // Every ID, one way and back; and a difference outside the map.
        let map = IdentificationMap::new(40);
        for id in 0..=u16::MAX {
            assert_eq!(map.solve(map.delta(id)), Some(id));
        }
        assert_eq!(map.solve(map.delta(0x1234) ^ 1 << 31), None);
    }

    #[test]
    fn the_unshifted_syndrome_is_the_id() {
        // Against the maps: every ID at three lengths, a spread of IDs at
        // every length up to the table's end and past it (the map's path).
        for len in [bth::HEADER_LEN + LEN, 40, 4096 + 28 + LEN] {
            let map = IdentificationMap::new(len);
            for id in 0..=u16::MAX {
                assert_eq!(solve_identification(len, map.delta(id)), Some(id));
            }
        }
        // Lengths past UNSHIFT_PACKET_MAX are solved by a map made then.
        let past = [UNSHIFT_PACKET_MAX + 1, 9000, 65535];
        for len in (bth::HEADER_LEN + LEN..=UNSHIFT_PACKET_MAX).chain(past) {
            let map = IdentificationMap::new(len);
            for id in [1u16, 0x80, 0x100, 0x4c36, 0xffff, len as u16] {
                assert_eq!(
                    solve_identification(len, map.delta(id)),
                    Some(id),
                    "len {len}"
                );
            }
            // What no ID explains, neither finds; a stray bit anywhere.
            for bit in [0, 7, 15, 16, 23, 31] {
                let bad = map.delta(0x4c36) ^ 1 << bit;
                let solved = solve_identification(len, bad);
                if past.contains(&len) {
                    // Solved by a map: checked against every ID instead.
                    match solved {
                        Some(id) => assert_eq!(map.delta(id), bad, "len {len}"),
                        None => assert!((0..=u16::MAX).all(|id| map.delta(id) != bad)),
                    }
                } else {
                    assert_eq!(solved, map.solve(bad), "len {len}");
                }
            }
        }
        // A real packet: its syndrome from one pass, solved.
        let flow = flow_to_4791([10, 0, 0, 1], [10, 0, 0, 2], 49152);
        let len = 301;
        let mut packet: Vec<u8> = (0..len).map(|i| (i * 5) as u8).collect();
        let crc = flow
            .icrc(0xbeef, (UDP_HEADER_LEN + len) as u16, &packet[..len - LEN])
            .unwrap()
            .finish();
        packet[len - LEN..].copy_from_slice(&crc.to_le_bytes());
        let syndrome = flow.syndrome(&packet).unwrap();
        assert_eq!(solve_identification(len, syndrome), Some(0xbeef));
        packet[40] ^= 1;
        assert_eq!(
            solve_identification(len, flow.syndrome(&packet).unwrap()),
            None
        );
    }

    #[test]
    fn a_kept_map_finds_what_its_solve_finds_guessing_the_next_id_first() {
        let map = IdentificationMap::new(40);
        let mut kept = Kept::new(map.clone());
        // A count by 2 (a ping-pong's WRITEs), a jump, a count by 1 across
        // the wrap, corrupt syndromes between: each as the map solves it.
        let ids: Vec<u16> = (0..20u16)
            .map(|k| 0x4c36 + 2 * k)
            .chain((0..20).map(|k| 0xfff6u16.wrapping_add(k)))
            .collect();
        for (k, &id) in ids.iter().enumerate() {
            let syndrome = map.delta(id);
            assert_eq!(kept.solve(syndrome), Some(id), "ID {id:#x}");
            if k % 7 == 3 {
                // One stray bit: no ID explains it (CRC-32 catches it).
                let bad = syndrome ^ 1 << (k % 32);
                assert_eq!(map.solve(bad), None);
                assert_eq!(kept.solve(bad), None, "after {id:#x}");
            }
        }
        // Guessed after each count's second ID: 18 of each count's 20.
        assert_eq!(kept.guessed, 36);
        assert_eq!(kept.last, Some((0x0009, map.delta(0x0009))));
        assert_eq!(kept.step, 1);
        // Guessed wrong: the solve's answer, and the new step, up or down.
        assert_eq!(kept.solve(map.delta(0x0100)), Some(0x0100));
        assert_eq!(kept.step, 0x0100 - 0x0009);
        assert_eq!(kept.solve(map.delta(0x0080)), Some(0x0080));
        assert_eq!(kept.step, 0x0080u16.wrapping_sub(0x0100));
        assert_eq!(kept.solve(map.delta(0x0000)), Some(0x0000));
        assert_eq!(kept.guessed, 37, "0x0000 after 0x0100, 0x0080");
    }

    #[test]
    fn maps_are_made_for_the_first_lengths_then_one_in_so_many_misses() {
        let mut maps = IdentificationMaps::new();
        let delta = |len| IdentificationMap::new(len).delta(0x1234);
        let kept = |maps: &IdentificationMaps| {
            let mut l: Vec<usize> = maps.lengths().collect();
            l.sort();
            l
        };
        // The first eight lengths met get maps.
        for len in 20..28 {
            assert_eq!(maps.solve(len, delta(len)), Some(0x1234));
            assert!(maps.lengths().any(|l| l == len));
        }
        assert_eq!(kept(&maps), (20..28).collect::<Vec<_>>());
        // Then lengths met get none until a miss is the 64th since...
        let misses = IdentificationMaps::MISSES_PER_MAP as usize;
        for len in 100..100 + misses - 1 {
            if len % 2 == 0 {
                assert_eq!(maps.solve(len, delta(len)), Some(0x1234));
            } else {
                assert_eq!(maps.solve(len, delta(len) ^ 1 << 3), None);
            }
        }
        assert_eq!(kept(&maps), (20..28).collect::<Vec<_>>());
        // ...whose length gets one in place of another,
        assert_eq!(maps.solve(4128, delta(4128)), Some(0x1234));
        assert!(maps.lengths().any(|l| l == 4128));
        assert_eq!(maps.lengths().count(), 8);
        // and the count starts again: hits do not count, misses do.
        for _ in 0..misses {
            assert_eq!(maps.solve(4128, delta(4128)), Some(0x1234));
        }
        for len in 200..200 + misses - 1 {
            assert_eq!(maps.solve(len, delta(len)), Some(0x1234));
        }
        assert!(!maps.lengths().any(|l| (200..300).contains(&l)));
        assert_eq!(maps.solve(300, delta(300)), Some(0x1234));
        assert!(maps.lengths().any(|l| l == 300));
    }

    #[test]
    fn fills() {
        let (ip, rest) = ACK_FRAME.split_at(20);
        let (udp, ib) = rest.split_at(8);
        let mut copy = ib.to_vec();
        copy[16..].fill(0);
        fill(ip, udp, &mut copy).unwrap();
        assert_eq!(copy, ib);
    }
}
