//! Reading the tools' out-of-band exchanges over TCP.

use std::io::{self, Read};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Fills `buf` from `stream`, whole within `limit` if one is given: a peer
/// that sends a byte a minute must not hold the setup for hours. The limit's
/// end is `WouldBlock`, as a read timeout's (`TimedOut` is the kernel's: a
/// connection that stopped answering).
pub fn read_whole(
    stream: &mut TcpStream,
    buf: &mut [u8],
    limit: Option<Duration>,
) -> io::Result<()> {
    let Some(limit) = limit else {
        return stream.read_exact(buf);
    };
    let deadline = Instant::now() + limit;
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
