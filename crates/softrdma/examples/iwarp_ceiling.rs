//! What an iWARP implementation over a TCP socket can reach on this machine
//! with no transport engine at all: the byte stream softrdma's iWARP
//! provider sends for RDMA WRITEs between softrdma ends, with only the work
//! the framing and direct placement make mandatory. The comparison bench
//! (`bench/compare.py`) runs it beside the peers, as `roce_ceiling` for
//! RoCEv2, so that a target above this ceiling shows as such in the same run.
//!
//! ```text
//! iwarp_ceiling stream SECS SIZE [--busy]   # prints "stream <GB/s>"
//! ```
//!
//! One thread sends WRITEs of SIZE bytes from a 1 MiB region as the
//! provider frames them between softrdma ends: FPDUs of MPA's largest ULPDU
//! (a 14-byte tagged DDP header and 65 513 payload bytes, the last of a
//! message shorter), each its 2-byte MPA length, header, payload, pad and a
//! CRC field (zero: CRC off, as `softrdma perf` runs), up to 16 FPDUs
//! (about 1 MiB) in one `writev` gathered straight from the region. Another thread
//! receives as the provider does: each payload read straight into its
//! place in a 1 MiB target, with the pad, the CRC field and the next FPDU's
//! header in the same `readv`. GB/s of payload received. Both block in the
//! socket calls; `--busy` makes them spin on non-blocking sockets instead.
//! Loopback only: 127.0.0.95 and 127.0.0.96.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use softrdma_wire::{ddp, mpa, rdmap};

const SERVER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 95);
const CLIENT: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 96);
const REGION: usize = 1 << 20;
const PAYLOAD: usize = mpa::MAX_ULPDU - ddp::TAGGED_HEADER_LEN;
/// MPA length and DDP tagged header: what precedes a payload.
const HEAD: usize = 2 + ddp::TAGGED_HEADER_LEN;
/// The provider's most FPDUs in one `writev`.
const MAX_BATCH: usize = 16;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |i: usize| args.get(i).and_then(|a| a.parse::<u64>().ok());
    let result = match (args.first().map(String::as_str), number(1), number(2)) {
        (Some("stream"), Some(secs), Some(size)) if (1..=REGION as u64).contains(&size) => {
            stream(secs, size as usize, args.iter().any(|a| a == "--busy"))
                .map(|gbs| println!("stream {gbs:.3}"))
        }
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "usage: iwarp_ceiling stream SECS SIZE [--busy] (SIZE 1 ..= 1 MiB)",
        )),
    };
    if let Err(e) = result {
        eprintln!("iwarp_ceiling: {e}");
        std::process::exit(1);
    }
}

/// One FPDU of a WRITE: where its payload sits in the message, and its
/// header and trailer bytes.
struct Fpdu {
    offset: usize,
    len: usize,
    head: [u8; HEAD],
    trailer: [u8; 7],
    trailer_len: usize,
}

/// The FPDUs of a WRITE of `size` bytes, as the provider frames them.
fn fpdus(size: usize) -> Vec<Fpdu> {
    let mut out = Vec::new();
    let mut offset = 0;
    while offset < size {
        let len = PAYLOAD.min(size - offset);
        let ulpdu = ddp::TAGGED_HEADER_LEN + len;
        let mut head = [0u8; HEAD];
        head[..2].copy_from_slice(&(ulpdu as u16).to_be_bytes());
        let mut seg = ddp::Segment::new_unchecked(&mut head[2..]);
        seg.set_control(true, offset + len == size, ddp::VERSION);
        seg.set_rsvd_ulp(rdmap::Opcode::Write.control_byte());
        seg.set_stag(0x1234_5600);
        seg.set_tagged_offset(offset as u64);
        out.push(Fpdu {
            offset,
            len,
            head,
            trailer: [0; 7],
            trailer_len: mpa::pad_len(ulpdu) + mpa::CRC_LEN,
        });
        offset += len;
    }
    out
}

fn stream(secs: u64, size: usize, busy: bool) -> io::Result<f64> {
    let listener = TcpListener::bind(SocketAddrV4::new(SERVER, 0))?;
    let to = listener.local_addr()?;
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    sock.bind(&std::net::SocketAddr::from(SocketAddrV4::new(CLIENT, 0)).into())?;
    sock.connect(&to.into())?;
    let sender: TcpStream = sock.into();
    let (receiver, _) = listener.accept()?;
    for s in [&sender, &receiver] {
        s.set_nodelay(true)?;
        s.set_nonblocking(busy)?;
    }
    let rx = std::thread::spawn(move || receive(receiver, size, busy));
    let region: Vec<u8> = (0..REGION).map(|i| (i * 7) as u8).collect();
    let frames = fpdus(size);
    // WRITE after WRITE, FPDUs batched across them as the provider's
    // transmit loop takes them: 16 FPDUs a call.
    let mut next = frames.iter().cycle();
    let start = Instant::now();
    let mut sender = sender;
    while start.elapsed() < Duration::from_secs(secs) {
        let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(3 * MAX_BATCH);
        for f in next.by_ref().take(MAX_BATCH) {
            iov.push(IoSlice::new(&f.head));
            iov.push(IoSlice::new(&region[f.offset..f.offset + f.len]));
            iov.push(IoSlice::new(&f.trailer[..f.trailer_len]));
        }
        if write_all(&mut sender, &mut iov, busy).is_err() {
            break;
        }
    }
    let _ = sender.shutdown(std::net::Shutdown::Write);
    let received = rx
        .join()
        .map_err(|_| io::Error::other("receiver panicked"))??;
    Ok(received as f64 / start.elapsed().as_secs_f64() / 1e9)
}

fn write_all(s: &mut TcpStream, mut iov: &mut [IoSlice<'_>], busy: bool) -> io::Result<()> {
    while !iov.is_empty() {
        match s.write_vectored(iov) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut iov, n),
            Err(e) if busy && e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads until `bufs` are full; false at the end of the stream.
fn read_all(s: &mut TcpStream, mut bufs: &mut [IoSliceMut<'_>], busy: bool) -> io::Result<bool> {
    while !bufs.is_empty() {
        match s.read_vectored(bufs) {
            Ok(0) => return Ok(false),
            Ok(n) => IoSliceMut::advance_slices(&mut bufs, n),
            Err(e) if busy && e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Receives FPDUs as the provider does, each payload into its place in a
/// target region, with the pad, the CRC field and the next FPDU's header in
/// the same `readv`; returns the payload bytes received.
fn receive(mut s: TcpStream, size: usize, busy: bool) -> io::Result<u64> {
    let mut target = vec![0u8; REGION];
    let mut head = [0u8; HEAD];
    let mut tail = [0u8; 7 + HEAD];
    let mut received = 0u64;
    if !read_all(&mut s, &mut [IoSliceMut::new(&mut head)], busy)? {
        return Ok(0);
    }
    loop {
        let ulpdu = usize::from(u16::from_be_bytes([head[0], head[1]]));
        let seg = ddp::Segment::new_checked(&head[2..])
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        let offset = seg.tagged_offset() as usize;
        let len = ulpdu
            .checked_sub(ddp::TAGGED_HEADER_LEN)
            .filter(|&l| offset + l <= size)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "FPDU out of bounds"))?;
        let trailer = mpa::pad_len(ulpdu) + mpa::CRC_LEN;
        let (pad_crc, next) = tail.split_at_mut(trailer);
        let mut bufs = [
            IoSliceMut::new(&mut target[offset..offset + len]),
            IoSliceMut::new(pad_crc),
            IoSliceMut::new(&mut next[..HEAD]),
        ];
        if !read_all(&mut s, &mut bufs, busy)? {
            // The stream ended: no header follows the last FPDU, which is
            // not counted (one FPDU of a run of seconds).
            return Ok(received);
        }
        received += len as u64;
        head.copy_from_slice(&next[..HEAD]);
    }
}
