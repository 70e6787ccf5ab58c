//! The ICRC over arbitrary IP/UDP/IB splits: never panics; fill then verify agrees.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softrdma_wire::icrc;

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let ip_len = usize::from(data[0] % 48);
    let rest = &data[1..];
    let (ip, rest) = rest.split_at(ip_len.min(rest.len()));
    let (udp, ib) = rest.split_at(8.min(rest.len()));
    let checked = icrc::verify(ip, udp, ib);
    let mut copy = ib.to_vec();
    if icrc::fill(ip, udp, &mut copy).is_ok() {
        assert!(icrc::verify(ip, udp, &copy).is_ok());
        assert_eq!(checked.is_ok(), copy == ib);
        // Whatever the ID, it follows from the ICRC.
        if ip.len() >= 20 && ip[0] == 0x45 {
            let real = u16::from_be_bytes([ip[4], ip[5]]);
            let mut blind = ip.to_vec();
            blind[4] = !blind[4];
            assert_eq!(
                icrc::solve_ipv4_identification(&blind, udp, &copy),
                Ok(Some(real))
            );
        }
    }
});
