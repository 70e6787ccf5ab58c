//! The 40-byte global route header area at the start of every UD receive buffer.
//!
//! On InfiniBand and RoCEv2 over IPv6 it holds the IPv6-shaped GRH (IBTA 8.3)
//! of the received packet. On RoCEv2 over IPv4 it holds 20 zero bytes followed
//! by the packet's IPv4 header (the kernel's `rdma_network_hdr` union; rxe
//! writes it so, and `ibv_create_ah_from_wc` reads it so).

use core::fmt;

use crate::bytes::{get_u16, get_u32, set_u16, set_u32};
use crate::{Error, Result};

mod field {
    use crate::bytes::Field;
    /// IPVer (31-28), TClass (27-20), FlowLabel (19-0).
    pub const VER_TC_FL: Field = 0..4;
    pub const PAY_LEN: Field = 4..6;
    pub const NEXT_HEADER: usize = 6;
    pub const HOP_LIMIT: usize = 7;
    pub const SGID: Field = 8..24;
    pub const DGID: Field = 24..40;
    /// Where the IPv4 header sits in the RoCEv2/IPv4 form.
    pub const IPV4: Field = 20..40;
}

/// Length of the GRH area.
pub const HEADER_LEN: usize = 40;

/// The IPv4-mapped IPv6 address (RoCEv2 GID) of an IPv4 address.
pub const fn ipv4_mapped(a: [u8; 4]) -> [u8; 16] {
    [
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a[0], a[1], a[2], a[3],
    ]
}

/// The IPv4 address inside an IPv4-mapped GID, if it is one.
pub fn ipv4_of_mapped(gid: &[u8; 16]) -> Option<[u8; 4]> {
    if gid[..10].iter().all(|&b| b == 0) && gid[10] == 0xff && gid[11] == 0xff {
        Some([gid[12], gid[13], gid[14], gid[15]])
    } else {
        None
    }
}

/// The Internet checksum (RFC 1071) of an IPv4 header.
pub fn ipv4_checksum(header: &[u8]) -> u16 {
    let mut sum: u32 = header
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

crate::bytes::fixed_header_view!(
    /// A view of a GRH area.
    Header, "GRH", HEADER_LEN
);

impl<T: AsRef<[u8]>> Header<T> {
    /// The area holds the RoCEv2/IPv4 form (20 zero bytes, then an IPv4 header).
    pub fn is_ipv4(&self) -> bool {
        let b = self.buffer.as_ref();
        b[..20].iter().all(|&x| x == 0) && b[20] >> 4 == 4
    }
    /// The embedded IPv4 header (meaningful when [`Header::is_ipv4`]).
    pub fn ipv4_header(&self) -> &[u8] {
        &self.buffer.as_ref()[field::IPV4]
    }
    /// IPVer of the IPv6-shaped form.
    pub fn ip_version(&self) -> u8 {
        self.buffer.as_ref()[0] >> 4
    }
    /// Traffic class.
    pub fn traffic_class(&self) -> u8 {
        (get_u32(self.buffer.as_ref(), field::VER_TC_FL) >> 20) as u8
    }
    /// Flow label (20 bits).
    pub fn flow_label(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::VER_TC_FL) & 0xf_ffff
    }
    /// Payload length.
    pub fn payload_len(&self) -> u16 {
        get_u16(self.buffer.as_ref(), field::PAY_LEN)
    }
    /// Next header (0x1b for IB's BTH, 17 for UDP in RoCEv2).
    pub fn next_header(&self) -> u8 {
        self.buffer.as_ref()[field::NEXT_HEADER]
    }
    /// Hop limit.
    pub fn hop_limit(&self) -> u8 {
        self.buffer.as_ref()[field::HOP_LIMIT]
    }
    /// Source GID.
    pub fn sgid(&self) -> [u8; 16] {
        let mut g = [0; 16];
        g.copy_from_slice(&self.buffer.as_ref()[field::SGID]);
        g
    }
    /// Destination GID.
    pub fn dgid(&self) -> [u8; 16] {
        let mut g = [0; 16];
        g.copy_from_slice(&self.buffer.as_ref()[field::DGID]);
        g
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Header<T> {
    /// Sets IPVer, traffic class and flow label.
    pub fn set_ver_tc_fl(&mut self, version: u8, traffic_class: u8, flow_label: u32) {
        let v = (u32::from(version & 0xf) << 28)
            | (u32::from(traffic_class) << 20)
            | (flow_label & 0xf_ffff);
        set_u32(self.buffer.as_mut(), field::VER_TC_FL, v);
    }
    /// Sets the payload length.
    pub fn set_payload_len(&mut self, v: u16) {
        set_u16(self.buffer.as_mut(), field::PAY_LEN, v);
    }
    /// Sets the next header.
    pub fn set_next_header(&mut self, v: u8) {
        self.buffer.as_mut()[field::NEXT_HEADER] = v;
    }
    /// Sets the hop limit.
    pub fn set_hop_limit(&mut self, v: u8) {
        self.buffer.as_mut()[field::HOP_LIMIT] = v;
    }
    /// Sets the source GID.
    pub fn set_sgid(&mut self, g: &[u8; 16]) {
        self.buffer.as_mut()[field::SGID].copy_from_slice(g);
    }
    /// Sets the destination GID.
    pub fn set_dgid(&mut self, g: &[u8; 16]) {
        self.buffer.as_mut()[field::DGID].copy_from_slice(g);
    }
    /// The embedded IPv4 header, writable.
    pub fn ipv4_header_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[field::IPV4]
    }
}

/// The contents of a GRH area.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repr {
    /// The IPv6-shaped GRH (InfiniBand, RoCEv2 over IPv6).
    Ipv6 {
        /// Traffic class.
        traffic_class: u8,
        /// Flow label (20 bits).
        flow_label: u32,
        /// Payload length.
        payload_len: u16,
        /// Next header.
        next_header: u8,
        /// Hop limit.
        hop_limit: u8,
        /// Source GID (IPv6 address).
        sgid: [u8; 16],
        /// Destination GID.
        dgid: [u8; 16],
    },
    /// RoCEv2 over IPv4: the IPv4 header of the packet.
    Ipv4 {
        /// Type of service (DSCP and ECN).
        tos: u8,
        /// Total length.
        total_len: u16,
        /// Identification.
        identification: u16,
        /// Flags and fragment offset.
        flags_fragment: u16,
        /// Time to live.
        ttl: u8,
        /// Protocol (17, UDP).
        protocol: u8,
        /// Source address.
        src: [u8; 4],
        /// Destination address.
        dst: [u8; 4],
    },
}

impl Repr {
    /// Parses a GRH area: the IPv4 form when the first 20 bytes are zero and an
    /// IPv4 header follows, else the IPv6-shaped form.
    pub fn parse<T: AsRef<[u8]>>(h: &Header<T>) -> Result<Repr> {
        h.check_len()?;
        if h.is_ipv4() {
            let ip = h.ipv4_header();
            if ip[0] != 0x45 {
                return Err(Error::InvalidField {
                    field: "IPv4 version/header length in GRH",
                    value: ip[0].into(),
                });
            }
            if ipv4_checksum(ip) != 0 {
                return Err(Error::InvalidField {
                    field: "IPv4 header checksum in GRH",
                    value: get_u16(ip, 10..12).into(),
                });
            }
            return Ok(Repr::Ipv4 {
                tos: ip[1],
                total_len: get_u16(ip, 2..4),
                identification: get_u16(ip, 4..6),
                flags_fragment: get_u16(ip, 6..8),
                ttl: ip[8],
                protocol: ip[9],
                src: [ip[12], ip[13], ip[14], ip[15]],
                dst: [ip[16], ip[17], ip[18], ip[19]],
            });
        }
        if h.ip_version() != 6 {
            return Err(Error::UnsupportedVersion {
                field: "GRH IP version",
                value: h.ip_version(),
            });
        }
        Ok(Repr::Ipv6 {
            traffic_class: h.traffic_class(),
            flow_label: h.flow_label(),
            payload_len: h.payload_len(),
            next_header: h.next_header(),
            hop_limit: h.hop_limit(),
            sgid: h.sgid(),
            dgid: h.dgid(),
        })
    }

    /// Bytes the area takes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the area (with a correct IPv4 header checksum in the IPv4 form).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Header<T>) {
        match *self {
            Repr::Ipv6 {
                traffic_class,
                flow_label,
                payload_len,
                next_header,
                hop_limit,
                sgid,
                dgid,
            } => {
                h.set_ver_tc_fl(6, traffic_class, flow_label);
                h.set_payload_len(payload_len);
                h.set_next_header(next_header);
                h.set_hop_limit(hop_limit);
                h.set_sgid(&sgid);
                h.set_dgid(&dgid);
            }
            Repr::Ipv4 {
                tos,
                total_len,
                identification,
                flags_fragment,
                ttl,
                protocol,
                src,
                dst,
            } => {
                h.buffer.as_mut()[..20].fill(0);
                let ip = h.ipv4_header_mut();
                ip[0] = 0x45;
                ip[1] = tos;
                set_u16(ip, 2..4, total_len);
                set_u16(ip, 4..6, identification);
                set_u16(ip, 6..8, flags_fragment);
                ip[8] = ttl;
                ip[9] = protocol;
                set_u16(ip, 10..12, 0);
                ip[12..16].copy_from_slice(&src);
                ip[16..20].copy_from_slice(&dst);
                let sum = ipv4_checksum(ip);
                set_u16(ip, 10..12, sum);
            }
        }
    }

    /// The source GID (IPv4-mapped for the IPv4 form).
    pub fn sgid(&self) -> [u8; 16] {
        match self {
            Repr::Ipv6 { sgid, .. } => *sgid,
            Repr::Ipv4 { src, .. } => ipv4_mapped(*src),
        }
    }

    /// The destination GID (IPv4-mapped for the IPv4 form).
    pub fn dgid(&self) -> [u8; 16] {
        match self {
            Repr::Ipv6 { dgid, .. } => *dgid,
            Repr::Ipv4 { dst, .. } => ipv4_mapped(*dst),
        }
    }
}

impl fmt::Display for Repr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Repr::Ipv6 {
                sgid,
                dgid,
                traffic_class,
                flow_label,
                hop_limit,
                ..
            } => write!(
                f,
                "GRH {} -> {} tc={traffic_class} fl={flow_label:#x} hop={hop_limit}",
                core::net::Ipv6Addr::from(*sgid),
                core::net::Ipv6Addr::from(*dgid)
            ),
            Repr::Ipv4 {
                src, dst, tos, ttl, ..
            } => write!(
                f,
                "GRH(IPv4) {} -> {} tos={tos} ttl={ttl}",
                core::net::Ipv4Addr::from(*src),
                core::net::Ipv4Addr::from(*dst)
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // rxe_write_bw.pcap frame 99's IPv4 header, as rxe would place it in a GRH area.
    const IPV4: [u8; 20] = [
        0x45, 0x00, 0x00, 0x30, 0x4c, 0x36, 0x40, 0x00, 0x40, 0x11, 0xd9, 0xbc, 0x0a, 0x63, 0x00,
        0x02, 0x0a, 0x63, 0x00, 0x03,
    ];

    #[test]
    fn ipv4_form() {
        let mut area = [0u8; 40];
        area[20..].copy_from_slice(&IPV4);
        let h = Header::new_checked(&area[..]).unwrap();
        assert!(h.is_ipv4());
        let r = Repr::parse(&h).unwrap();
        assert_eq!(
            r,
            Repr::Ipv4 {
                tos: 0,
                total_len: 48,
                identification: 0x4c36,
                flags_fragment: 0x4000,
                ttl: 64,
                protocol: 17,
                src: [10, 99, 0, 2],
                dst: [10, 99, 0, 3]
            }
        );
        assert_eq!(r.sgid(), ipv4_mapped([10, 99, 0, 2]));
        assert_eq!(ipv4_of_mapped(&r.dgid()), Some([10, 99, 0, 3]));
        let mut out = [0xeeu8; 40];
        r.emit(&mut Header::new_unchecked(&mut out[..]));
        assert_eq!(out, area, "emit recomputes the same checksum");
        assert_eq!(
            r.to_string(),
            "GRH(IPv4) 10.99.0.2 -> 10.99.0.3 tos=0 ttl=64"
        );
    }

    #[test]
    fn malformed() {
        assert!(Header::new_checked(&[0u8; 39][..]).is_err());
        let mut area = [0u8; 40];
        area[20..].copy_from_slice(&IPV4);
        area[31] ^= 1; // checksum
        assert!(Repr::parse(&Header::new_unchecked(&area[..])).is_err());
        let area = [0u8; 40];
        assert!(matches!(
            Repr::parse(&Header::new_unchecked(&area[..])),
            Err(Error::UnsupportedVersion { value: 0, .. })
        ));
    }

    proptest! {
        #[test]
        fn ipv6_round_trip(tc: u8, fl in 0u32..(1 << 20), len: u16, nh: u8, hop: u8,
                           s: [u8; 16], d: [u8; 16]) {
            let r = Repr::Ipv6 { traffic_class: tc, flow_label: fl, payload_len: len,
                                 next_header: nh, hop_limit: hop, sgid: s, dgid: d };
            let mut buf = [0u8; HEADER_LEN];
            r.emit(&mut Header::new_unchecked(&mut buf[..]));
            prop_assert_eq!(Repr::parse(&Header::new_checked(&buf[..]).unwrap()).unwrap(), r);
        }

        #[test]
        fn ipv4_round_trip(tos: u8, len: u16, id: u16, ff: u16, ttl: u8, p: u8,
                           s: [u8; 4], d: [u8; 4]) {
            let r = Repr::Ipv4 { tos, total_len: len, identification: id, flags_fragment: ff,
                                 ttl, protocol: p, src: s, dst: d };
            let mut buf = [0u8; HEADER_LEN];
            r.emit(&mut Header::new_unchecked(&mut buf[..]));
            prop_assert_eq!(Repr::parse(&Header::new_checked(&buf[..]).unwrap()).unwrap(), r);
        }
    }
}
