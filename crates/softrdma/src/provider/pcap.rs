//! A pcap of what a device sends and receives, with synthesized IPv4 and UDP
//! headers (raw-IP link type), for tshark and `softrdma decode`.
//!
//! Received packets carry the IP Identification that the ICRC check found
//! (rxe's counting ID), so that the ICRC verifies in the capture too. Each
//! record copies the packet: this is a diagnostic, not a fast path.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::net::SocketAddrV4;
use std::path::Path;
use std::time::SystemTime;

/// LINKTYPE_RAW: each record is an IP packet.
const LINKTYPE_RAW: u32 = 101;

/// Where one packet went, and its IP header fields.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PacketMeta {
    pub src: SocketAddrV4,
    pub dst: SocketAddrV4,
    pub identification: u16,
    pub ttl: u8,
    pub tos: u8,
}

#[derive(Debug)]
pub(crate) struct PcapWriter {
    out: BufWriter<File>,
}

impl PcapWriter {
    pub fn create(path: &Path) -> io::Result<PcapWriter> {
        let mut out = BufWriter::new(File::create(path)?);
        out.write_all(&0xa1b2_c3d4u32.to_le_bytes())?;
        out.write_all(&2u16.to_le_bytes())?;
        out.write_all(&4u16.to_le_bytes())?;
        out.write_all(&0i32.to_le_bytes())?;
        out.write_all(&0u32.to_le_bytes())?;
        out.write_all(&262_144u32.to_le_bytes())?;
        out.write_all(&LINKTYPE_RAW.to_le_bytes())?;
        out.flush()?;
        Ok(PcapWriter { out })
    }

    /// Writes one packet whose UDP payload is the concatenation of `parts`.
    pub fn record(&mut self, m: &PacketMeta, parts: &[&[u8]]) -> io::Result<()> {
        let payload: usize = parts.iter().map(|p| p.len()).sum();
        let udp_len = 8 + payload;
        let total = 20 + udp_len;
        let mut ip = [0u8; 20];
        ip[0] = 0x45;
        ip[1] = m.tos;
        ip[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        ip[4..6].copy_from_slice(&m.identification.to_be_bytes());
        ip[6] = 0x40; // DF
        ip[8] = m.ttl;
        ip[9] = 17;
        ip[12..16].copy_from_slice(&m.src.ip().octets());
        ip[16..20].copy_from_slice(&m.dst.ip().octets());
        let sum = softrdma_wire::grh::ipv4_checksum(&ip);
        ip[10..12].copy_from_slice(&sum.to_be_bytes());
        let mut udp = [0u8; 8];
        udp[0..2].copy_from_slice(&m.src.port().to_be_bytes());
        udp[2..4].copy_from_slice(&m.dst.port().to_be_bytes());
        udp[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
        // UDP checksum 0: none, as rxe sends.
        let t = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        self.out.write_all(&(t.as_secs() as u32).to_le_bytes())?;
        self.out.write_all(&t.subsec_micros().to_le_bytes())?;
        self.out.write_all(&(total as u32).to_le_bytes())?;
        self.out.write_all(&(total as u32).to_le_bytes())?;
        self.out.write_all(&ip)?;
        self.out.write_all(&udp)?;
        for p in parts {
            self.out.write_all(p)?;
        }
        // Whole records on disk even if the process is killed.
        self.out.flush()
    }
}
