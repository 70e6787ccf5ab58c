//! The host's network interfaces, for naming RoCEv2 devices after them (one
//! per IPv4 address, as rxe makes one per netdev) and for their link MTU.

use std::collections::BTreeMap;
use std::io;
use std::net::Ipv4Addr;

/// One network interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Netdev {
    /// Interface name (`eth0`).
    pub name: String,
    /// Link MTU, if the kernel tells it.
    pub mtu: Option<usize>,
    /// Hardware address, if it has one (not loopback).
    pub mac: Option<[u8; 6]>,
    /// IPv4 addresses, in the kernel's order.
    pub ipv4: Vec<Ipv4Addr>,
    /// Whether it is the loopback interface.
    pub loopback: bool,
}

/// The interfaces that are up, in the kernel's order.
pub fn interfaces() -> io::Result<Vec<Netdev>> {
    use nix::net::if_::InterfaceFlags;
    let mut order: Vec<String> = Vec::new();
    let mut devs: BTreeMap<String, Netdev> = BTreeMap::new();
    for ifa in nix::ifaddrs::getifaddrs().map_err(io::Error::from)? {
        if !ifa.flags.contains(InterfaceFlags::IFF_UP) {
            continue;
        }
        let dev = devs.entry(ifa.interface_name.clone()).or_insert_with(|| {
            order.push(ifa.interface_name.clone());
            Netdev {
                name: ifa.interface_name.clone(),
                mtu: link_mtu(&ifa.interface_name),
                mac: None,
                ipv4: Vec::new(),
                loopback: ifa.flags.contains(InterfaceFlags::IFF_LOOPBACK),
            }
        });
        let Some(addr) = ifa.address else { continue };
        if let Some(v4) = addr.as_sockaddr_in() {
            dev.ipv4.push(v4.ip());
        } else if let Some(mac) = addr.as_link_addr().and_then(|l| l.addr())
            && mac != [0; 6]
        {
            dev.mac = Some(mac);
        }
    }
    Ok(order.into_iter().filter_map(|n| devs.remove(&n)).collect())
}

/// An interface's MTU, asked of the kernel through a socket, so that it is
/// this network namespace's even where `/sys` shows another's (`nsenter
/// --net` leaves the host's sysfs mounted).
fn link_mtu(name: &str) -> Option<usize> {
    let bytes = name.as_bytes();
    if bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
        return None;
    }
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None).ok()?;
    // SAFETY: `ifreq` is plain old data, valid all zeros. The name is copied
    // in with room for its NUL (checked above). SIOCGIFMTU reads the name and
    // writes only `ifru_mtu` of the request the pointer names, which lives
    // across the call; the union field read is the one the kernel wrote (or
    // the zero it started as).
    let mtu = unsafe {
        let mut request: libc::ifreq = std::mem::zeroed();
        for (to, from) in request.ifr_name.iter_mut().zip(bytes) {
            *to = *from as libc::c_char;
        }
        if libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&socket),
            libc::SIOCGIFMTU,
            &mut request,
        ) != 0
        {
            return None;
        }
        request.ifr_ifru.ifru_mtu
    };
    usize::try_from(mtu).ok().filter(|&m| m > 0)
}

/// The interface that has `ip`, if any.
pub fn owner_of(ip: Ipv4Addr) -> Option<Netdev> {
    interfaces()
        .ok()?
        .into_iter()
        .find(|d| d.ipv4.contains(&ip))
}

/// The local address the kernel's route to `peer` uses.
pub fn route_to(peer: Ipv4Addr) -> io::Result<Ipv4Addr> {
    let s = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
    s.connect((peer, 4791))?;
    match s.local_addr()?.ip() {
        std::net::IpAddr::V4(a) => Ok(a),
        std::net::IpAddr::V6(_) => Err(io::Error::other(format!("no IPv4 route to {peer}"))),
    }
}

/// The IPv6 link-local GID made from a MAC (EUI-64, as rxe's GID 0).
pub fn link_local_gid(mac: [u8; 6]) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[0] = 0xfe;
    g[1] = 0x80;
    g[8] = mac[0] ^ 0x02;
    g[9] = mac[1];
    g[10] = mac[2];
    g[11] = 0xff;
    g[12] = 0xfe;
    g[13] = mac[3];
    g[14] = mac[4];
    g[15] = mac[5];
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_local_gid_is_rxes() {
        // rxe's GID 0 for MAC 52:54:0a:63:00:02 (the harness guests):
        // fe80::5054:aff:fe63:2.
        let g = link_local_gid([0x52, 0x54, 0x0a, 0x63, 0x00, 0x02]);
        assert_eq!(
            std::net::Ipv6Addr::from(g).to_string(),
            "fe80::5054:aff:fe63:2"
        );
    }

    fn loopback() -> Netdev {
        interfaces()
            .unwrap()
            .into_iter()
            .find(|d| d.loopback)
            .expect("a loopback interface")
    }

    #[test]
    fn loopback_is_listed_with_its_address() {
        let lo = loopback();
        assert!(lo.ipv4.contains(&Ipv4Addr::LOCALHOST));
        assert_eq!(lo.mac, None);
    }

    #[test]
    fn the_link_mtu_is_the_kernels() {
        let lo = loopback();
        // Tests run where sysfs and the network namespace agree.
        let sysfs: usize = std::fs::read_to_string(format!("/sys/class/net/{}/mtu", lo.name))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_eq!(lo.mtu, Some(sysfs));
        assert_eq!(link_mtu("no-such-if0"), None);
        assert_eq!(link_mtu("a-name-too-long-for-ifreq"), None);
        assert_eq!(link_mtu("l\0o"), None);
    }
}
