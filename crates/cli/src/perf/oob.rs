//! perftest's out-of-band exchange over TCP (no rdma_cm): fixed-size
//! messages, each a lock-step swap (the client writes first, the server
//! reads first); see `../shared/TOOLS-PROTOCOLS.md` section 2.

use std::io::{self, Read, Write};
use std::net::TcpStream;

/// The version perftest 4.5 reports (its package version); peers older than
/// 5.70 are refused, as perftest refuses them.
pub const VERSION: &str = "6.06";
const OLDEST_PEER: f64 = 5.70;
/// A key message: `KEY_PRINT_FMT_GID` and its NUL.
pub const KEY_LEN: usize = 108;

/// One side's QP, as a key message carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    pub lid: u16,
    pub out_reads: u16,
    pub qpn: u32,
    pub psn: u32,
    pub rkey: u32,
    pub vaddr: u64,
    pub gid: [u8; 16],
    pub srqn: u32,
}

impl Key {
    pub fn encode(&self) -> [u8; KEY_LEN] {
        let mut s = format!(
            "{:04x}:{:04x}:{:06x}:{:06x}:{:08x}:{:016x}:",
            self.lid, self.out_reads, self.qpn, self.psn, self.rkey, self.vaddr
        );
        for b in self.gid {
            s.push_str(&format!("{b:02x}:"));
        }
        s.push_str(&format!("{:08x}:", self.srqn));
        let mut out = [0u8; KEY_LEN];
        out[..s.len()].copy_from_slice(s.as_bytes());
        out
    }

    pub fn parse(bytes: &[u8; KEY_LEN]) -> Result<Key, String> {
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(KEY_LEN);
        let text = std::str::from_utf8(&bytes[..end]).map_err(|_| "a key message not in ASCII")?;
        let f: Vec<&str> = text.split(':').collect();
        if f.len() < 23 {
            return Err(format!("a key message with {} fields: {text:?}", f.len()));
        }
        let hex = |i: usize, max: u64| -> Result<u64, String> {
            u64::from_str_radix(f[i], 16)
                .ok()
                .filter(|&v| v <= max)
                .ok_or(format!("bad field {i} in key message {text:?}"))
        };
        let mut gid = [0u8; 16];
        for (k, g) in gid.iter_mut().enumerate() {
            *g = hex(6 + k, 0xff)? as u8;
        }
        Ok(Key {
            lid: hex(0, 0xffff)? as u16,
            out_reads: hex(1, 0xffff)? as u16,
            qpn: hex(2, 0xff_ffff)? as u32,
            psn: hex(3, 0xff_ffff)? as u32,
            rkey: hex(4, u64::from(u32::MAX))? as u32,
            vaddr: hex(5, u64::MAX)?,
            gid,
            srqn: hex(22, u64::from(u32::MAX))? as u32,
        })
    }
}

/// The bandwidth report a client sends after a BW test.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Report {
    pub size: u64,
    pub iters: u64,
    pub bw_peak: f64,
    pub bw_avg: f64,
    pub msg_rate: f64,
}

/// The TCP connection of the exchange.
#[derive(Debug)]
pub struct Oob {
    stream: TcpStream,
    client: bool,
}

fn ctx(what: &'static str) -> impl Fn(io::Error) -> String {
    move |e| format!("out-of-band exchange ({what}): {e}")
}

impl Oob {
    pub fn new(stream: TcpStream, client: bool) -> Oob {
        let _ = stream.set_nodelay(true);
        Oob { stream, client }
    }

    /// One lock-step swap of `mine` for as many bytes of the peer's.
    fn xchg(&mut self, mine: &[u8], theirs: &mut [u8]) -> io::Result<()> {
        // perftest reads each message with one read(): one write each.
        if self.client {
            self.stream.write_all(mine)?;
            self.stream.read_exact(theirs)
        } else {
            self.stream.read_exact(theirs)?;
            self.stream.write_all(mine)
        }
    }

    /// Version, page ("cycle buffer") size, cache line size and MTU: returns
    /// the cycle buffer, the cache line and the MTU enum both use.
    pub fn preamble(
        &mut self,
        cycle: u32,
        cache_line: u32,
        mtu: u8,
    ) -> Result<(u32, u32, u8), String> {
        let mut v = [0u8; 16];
        v[..VERSION.len()].copy_from_slice(VERSION.as_bytes());
        let mut rv = [0u8; 16];
        self.xchg(&v, &mut rv).map_err(ctx("version"))?;
        let end = rv.iter().position(|&b| b == 0).unwrap_or(16);
        let remote = String::from_utf8_lossy(&rv[..end]).to_string();
        let num: f64 = remote
            .split(|c: char| !(c.is_ascii_digit() || c == '.'))
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0.0);
        if num < OLDEST_PEER {
            return Err(format!(
                "the peer's perftest version {remote:?} is older than {OLDEST_PEER} \
                 (perftest refuses it too)"
            ));
        }
        let mut r4 = [0u8; 4];
        self.xchg(&cycle.to_be_bytes(), &mut r4)
            .map_err(ctx("cycle buffer"))?;
        let cycle = cycle.max(u32::from_be_bytes(r4));
        self.xchg(&cache_line.to_be_bytes(), &mut r4)
            .map_err(ctx("cache line"))?;
        let cache_line = cache_line.max(u32::from_be_bytes(r4));
        let mut m = [0u8; 2];
        m[0] = b'0' + mtu;
        let mut rm = [0u8; 2];
        self.xchg(&m, &mut rm).map_err(ctx("MTU"))?;
        let remote_mtu = rm[0].wrapping_sub(b'0');
        let mtu = if (1..=5).contains(&remote_mtu) {
            mtu.min(remote_mtu)
        } else {
            mtu
        };
        Ok((cycle, cache_line, mtu))
    }

    /// A key handshake: sends `mine`, returns the peer's.
    pub fn key(&mut self, mine: &Key) -> Result<Key, String> {
        let mut theirs = [0u8; KEY_LEN];
        self.xchg(&mine.encode(), &mut theirs)
            .map_err(ctx("key message"))?;
        Key::parse(&theirs)
    }

    /// The bandwidth report exchange: five 8-byte big-endian values.
    pub fn report(&mut self, mine: &Report) -> Result<Report, String> {
        let mut vals = [0u64; 5];
        let out = [
            mine.size,
            mine.iters,
            mine.bw_peak.to_bits(),
            mine.bw_avg.to_bits(),
            mine.msg_rate.to_bits(),
        ];
        for (o, v) in out.iter().zip(vals.iter_mut()) {
            let mut b = [0u8; 8];
            self.xchg(&o.to_be_bytes(), &mut b).map_err(ctx("report"))?;
            *v = u64::from_be_bytes(b);
        }
        Ok(Report {
            size: vals[0],
            iters: vals[1],
            bw_peak: f64::from_bits(vals[2]),
            bw_avg: f64::from_bits(vals[3]),
            msg_rate: f64::from_bits(vals[4]),
        })
    }

    /// Waits (at most `limit`) for the peer to close the connection: for
    /// write-lat, which ends without a closing exchange, so that this side's
    /// QP stays up to acknowledge the peer's last WRITE.
    pub fn linger(mut self, limit: std::time::Duration) {
        // Half-close first: a softrdma peer lingering too sees the end.
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        let _ = self.stream.set_read_timeout(Some(limit));
        let mut buf = [0u8; 64];
        while matches!(self.stream.read(&mut buf), Ok(n) if n > 0) {}
    }

    /// perftest's close: a last key handshake, then "done" (which nobody
    /// reads: the peer may already have closed, so errors after the
    /// handshake are not failures).
    pub fn close(mut self, mine: &Key) -> Result<(), String> {
        self.key(mine)?;
        let _ = self.stream.write_all(b"done\0");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_message_is_perftests() {
        // rxe_write_bw.pcap frame 17.
        let text = "0000:0001:000011:037d1a:000002ab:00007f8ba99f4000:00:00:00:00:00:00:00:00:00:00:ff:ff:0a:63:00:03:00000000:";
        let mut bytes = [0u8; KEY_LEN];
        bytes[..text.len()].copy_from_slice(text.as_bytes());
        assert_eq!(text.len() + 1, KEY_LEN);
        let k = Key::parse(&bytes).unwrap();
        assert_eq!(
            k,
            Key {
                lid: 0,
                out_reads: 1,
                qpn: 0x11,
                psn: 0x037d1a,
                rkey: 0x2ab,
                vaddr: 0x7f8b_a99f_4000,
                gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 99, 0, 3],
                srqn: 0,
            }
        );
        assert_eq!(k.encode(), bytes);
    }

    #[test]
    fn bad_key_messages_are_errors() {
        for text in [
            "",
            "0000:0001",
            "zzzz:0001:000011:037d1a:000002ab:00007f8ba99f4000:00:00:00:00:00:00:00:00:00:00:ff:ff:0a:63:00:03:00000000:",
        ] {
            let mut bytes = [0u8; KEY_LEN];
            bytes[..text.len()].copy_from_slice(text.as_bytes());
            assert!(Key::parse(&bytes).is_err(), "{text}");
        }
        assert!(Key::parse(&[0xff; KEY_LEN]).is_err());
    }
}
