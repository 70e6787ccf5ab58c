//! Choosing a device as the rdma-core tools do (`-d`, a GID index), and
//! `softrdma devices`.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::ExitCode;

use softrdma::verbs::{Device, DeviceInfo, IPV4_GID_INDEX, devices};

/// The local address a device sends from, and the device to open there.
#[derive(Debug)]
pub struct Chosen {
    /// The device's name, when it is one of `softrdma devices`.
    pub name: Option<String>,
    /// Its IPv4 address.
    pub addr: Ipv4Addr,
    link_mtu: Option<usize>,
}

impl Chosen {
    /// A libibverbs device, by name (its address comes with the context).
    pub fn named(name: &str) -> Chosen {
        Chosen {
            name: Some(name.to_string()),
            addr: Ipv4Addr::UNSPECIFIED,
            link_mtu: None,
        }
    }

    /// The device on `udp_port`.
    pub fn device(&self, udp_port: u16) -> Device {
        let d = Device::udp(SocketAddrV4::new(self.addr, udp_port).into());
        match self.link_mtu {
            Some(m) => d.link_mtu(m),
            None => d,
        }
    }
}

/// Whether libibverbs device `name` is an RNIC (iWARP, such as siw): its
/// node type in sysfs says 4.
pub fn is_rnic(name: &str) -> bool {
    !name.contains('/')
        && std::fs::read_to_string(format!("/sys/class/infiniband/{name}/node_type"))
            .is_ok_and(|t| t.trim_start().starts_with("4:"))
}

/// A libibverbs device's QPs send from its RoCEv2 IPv4 GID, the last of
/// the `gids` it lists: the GID index given with `flag` must be that one.
pub fn check_ibverbs_gid(flag: &str, gid: usize, name: &str, gids: usize) -> Result<(), String> {
    let want = gids.saturating_sub(1);
    if gid != want {
        return Err(format!(
            "{flag} {gid}: {name} sends from its RoCEv2 IPv4 GID, index {want}: use {flag} {want}"
        ));
    }
    Ok(())
}

fn check_gid(name: &str, gid: usize) -> Result<(), String> {
    match gid {
        IPV4_GID_INDEX => Ok(()),
        0 => Err(format!(
            "GID index 0 of {name} is the IPv6 link-local GID; softrdma speaks RoCEv2 \
             over IPv4 only so far: use GID index {IPV4_GID_INDEX}"
        )),
        n => Err(format!(
            "{name} has no GID index {n} (0: IPv6 link-local, {IPV4_GID_INDEX}: IPv4)"
        )),
    }
}

fn by_addr(all: &[DeviceInfo], addr: Ipv4Addr) -> Chosen {
    let info = all.iter().find(|d| d.addr == addr);
    Chosen {
        name: info.map(|d| d.name.clone()),
        addr,
        link_mtu: info.and_then(|d| d.link_mtu),
    }
}

/// The device: `-d NAME`, else the one at `--bind`, else (a client) the one
/// whose address routes to `peer`, else (a server) the first non-loopback one.
pub fn choose(
    dev: Option<&str>,
    gid: usize,
    bind: Option<Ipv4Addr>,
    peer: Option<Ipv4Addr>,
) -> Result<Chosen, String> {
    let all = devices().map_err(|e| e.to_string())?;
    let chosen = match (dev, bind) {
        (Some(name), _) => {
            let d = all.iter().find(|d| d.name == name).ok_or_else(|| {
                let names: Vec<&str> = all.iter().map(|d| d.name.as_str()).collect();
                format!(
                    "no device {name} (this host has: {}); see `softrdma devices`",
                    names.join(", ")
                )
            })?;
            if let Some(b) = bind
                && b != d.addr
            {
                return Err(format!(
                    "--bind {b} is not the address of {name} ({})",
                    d.addr
                ));
            }
            by_addr(&all, d.addr)
        }
        (None, Some(b)) => by_addr(&all, b),
        (None, None) => match peer {
            Some(p) => by_addr(&all, route_to(p)?),
            None => {
                let d = all.iter().find(|d| !d.loopback).ok_or(
                    "no non-loopback device: give -d DEVICE or --bind ADDRESS \
                     (see `softrdma devices`)",
                )?;
                by_addr(&all, d.addr)
            }
        },
    };
    check_gid(
        chosen
            .name
            .as_deref()
            .unwrap_or(&format!("the device at {}", chosen.addr)),
        gid,
    )?;
    Ok(chosen)
}

/// The local address the kernel's route to `peer` uses.
pub fn route_to(peer: Ipv4Addr) -> Result<Ipv4Addr, String> {
    softrdma::provider::netdev::route_to(peer).map_err(|e| format!("no route to {peer}: {e}"))
}

fn gid_text(g: &[u8; 16]) -> String {
    g.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

/// `softrdma devices`: each device with its GID table (as rdma-core's
/// `show_gids` prints it).
pub fn list() -> ExitCode {
    let all = match devices() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("softrdma devices: {e}");
            return ExitCode::FAILURE;
        }
    };
    outln!(
        "{:<16} {:<4} {:<5} {:<39} {:<15} {:<4} {:<8} NDEV",
        "DEV",
        "PORT",
        "INDEX",
        "GID",
        "IPv4",
        "VER",
        "MTU"
    );
    outln!(
        "{:<16} {:<4} {:<5} {:<39} {:<15} {:<4} {:<8} ----",
        "---",
        "----",
        "-----",
        "---",
        "------------",
        "---",
        "---"
    );
    for d in &all {
        let mtu = d.link_mtu.map_or("-".to_string(), |m| m.to_string());
        for (i, g) in d.gids.iter().enumerate() {
            if *g == [0; 16] {
                continue;
            }
            let v4 = if i == IPV4_GID_INDEX {
                d.addr.to_string()
            } else {
                String::new()
            };
            outln!(
                "{:<16} {:<4} {:<5} {:<39} {:<15} {:<4} {:<8} {}",
                d.name,
                1,
                i,
                gid_text(g),
                v4,
                "v2",
                mtu,
                d.netdev
            );
        }
    }
    // Devices of rdma-core (--provider ibverbs -d NAME), where it is installed.
    match softrdma::verbs::ibverbs_devices() {
        Ok(names) if !names.is_empty() => {
            outln!(
                "libibverbs devices (--provider ibverbs -d NAME): {}",
                names.join(", ")
            );
        }
        Ok(_) => outln!("libibverbs devices: none"),
        Err(e) => outln!("libibverbs devices: none; {e}"),
    }
    if all.is_empty() {
        eprintln!("softrdma devices: no interface with an IPv4 address is up");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
