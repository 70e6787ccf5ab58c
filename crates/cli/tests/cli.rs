//! The `softrdma` command: `decode` on intact and damaged captures, `demo`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data")
        .join(name)
}

fn decode(args: &[&str], file: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .arg("decode")
        .args(args)
        .arg(file)
        .output()
        .expect("run softrdma")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The summary line's error count.
fn errors(o: &Output) -> u64 {
    let out = stdout(o);
    let last = out.lines().last().unwrap_or_default();
    let n = last
        .rsplit("; ")
        .next()
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_else(|| panic!("no summary in {out}"));
    n.parse().unwrap()
}

fn write_temp(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.path().join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn flip_first(bytes: &mut [u8], pattern: &[u8]) {
    let at = bytes
        .windows(pattern.len())
        .position(|w| w == pattern)
        .expect("pattern in capture");
    bytes[at] ^= 0x01;
}

#[test]
fn a_reader_that_has_gone_ends_the_output_quietly() {
    // stdout is a pipe whose reading end is already closed: every write
    // fails with EPIPE, as behind `| head` once head has exited.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    // `devices` prints its table line by line (it panicked here before).
    let o = Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .arg("devices")
        .stdout(writer)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn every_shared_capture_decodes_cleanly_but_the_inverted_icrc() {
    let mut names: Vec<String> = std::fs::read_dir(data(""))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".pcap"))
        .collect();
    names.sort();
    assert!(names.len() >= 18, "{names:?}");
    for name in names {
        let o = decode(&[], &data(&name));
        if name == "server_mode_host_client.pcap" {
            assert_eq!(o.status.code(), Some(1), "{name}");
            assert_eq!(errors(&o), 1, "{name}");
            let bad: Vec<_> = stdout(&o)
                .lines()
                .filter(|l| l.contains("!!"))
                .map(String::from)
                .collect();
            assert_eq!(bad.len(), 1);
            assert!(bad[0].trim_start().starts_with("17 "), "{bad:?}");
            assert!(bad[0].contains("bad ICRC"), "{bad:?}");
        } else {
            assert!(o.status.success(), "{name}: {}", stdout(&o));
            assert_eq!(errors(&o), 0, "{name}");
        }
    }
}

#[test]
fn lines_show_the_key_fields() {
    let o = decode(&[], &data("rxe_read_bw.pcap"));
    let out = stdout(&o);
    let req = out
        .lines()
        .find(|l| l.contains("RDMA_READ_REQUEST"))
        .unwrap();
    for want in [
        "10.99.0.3:49441 -> 10.99.0.2:4791",
        "dqp=0x000011",
        "psn=0x86ca48",
        "rkey=0x202",
        "len=4096",
    ] {
        assert!(req.contains(want), "{want} not in {req}");
    }
    let o = decode(&[], &data("rxe_rping.pcap"));
    assert!(stdout(&o).contains("MAD CM REQ"));
    let o = decode(&[], &data("siw_rping.pcap"));
    let out = stdout(&o);
    assert!(out.contains("MPA Request rev=2 ird=1 ord=1"), "{out}");
    assert!(out.contains("RDMAP RDMA Read Request"), "{out}");
}

#[test]
fn a_flipped_roce_payload_byte_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = std::fs::read(data("rxe_rc_pingpong.pcap")).unwrap();
    // ibv_rc_pingpong fills its buffers with 0x7b.
    flip_first(&mut bytes, &[0x7b; 32]);
    let p = write_temp(&dir, "flipped.pcap", &bytes);
    let o = decode(&["--quiet"], &p);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(errors(&o), 1);
    assert!(stdout(&o).contains("bad ICRC"));
}

#[test]
fn a_flipped_iwarp_payload_byte_is_reported_when_crc_is_on() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = std::fs::read(data("siwcrc_rping.pcap")).unwrap();
    // The end of frame 10's rdma_info and its CRC32c.
    flip_first(
        &mut bytes,
        &[0x00, 0x00, 0x00, 0x40, 0x8c, 0x15, 0x3b, 0xcc],
    );
    let p = write_temp(&dir, "flipped.pcap", &bytes);
    let o = decode(&[], &p);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(errors(&o), 1);
    assert!(stdout(&o).contains("bad MPA CRC32c"));
}

#[test]
fn a_truncated_capture_decodes_what_is_there_then_fails() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(data("rxe_write_bw.pcap")).unwrap();
    let p = write_temp(&dir, "cut.pcap", &bytes[..bytes.len() / 2 + 7]);
    let o = decode(&[], &p);
    assert_eq!(o.status.code(), Some(1));
    let out = stdout(&o);
    assert!(out.contains("capture truncated"), "{out}");
    assert!(out.contains("RDMA_WRITE_FIRST"), "{out}");
}

/// A link type the decoder can't read fails the run, said once, not per frame;
/// output that can't be written fails it too.
#[test]
fn an_unreadable_link_type_or_output_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = std::fs::read(data("rxe_write_bw.pcap")).unwrap();
    // The pcap header's link type: 105, 802.11.
    bytes[20..24].copy_from_slice(&105u32.to_le_bytes());
    let p = write_temp(&dir, "wifi.pcap", &bytes);
    let o = decode(&[], &p);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let out = stdout(&o);
    assert_eq!(out.matches("link type 105").count(), 1, "{out}");
    assert_eq!(errors(&o), 1, "{out}");
    let full = std::fs::File::options()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .args(["decode", data("rxe_write_bw.pcap").to_str().unwrap()])
        .stdout(full)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("No space left"),
        "{o:?}"
    );
}

#[test]
fn not_a_capture() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_temp(&dir, "text.pcap", b"this is not a capture at all\n");
    let o = decode(&[], &p);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("not a pcap or pcapng capture"), "{err}");
    let p = write_temp(&dir, "empty.pcap", b"");
    let o = decode(&[], &p);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("only 0 bytes"));
    let o = decode(&[], &dir.path().join("missing.pcap"));
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot read"));
}

#[test]
fn bad_flags_are_refused() {
    let o = decode(&["--roce-port", "notaport"], &data("rxe_rping.pcap"));
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("invalid value"));
    let o = Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(o.status.success());
    assert!(stdout(&o).contains("decode"));
    // perf flags out of range: a message and a failing exit, no panic.
    for args in [
        ["perf", "write-bw", "-D", "100000000000"],
        ["perf", "write-bw", "-D", "0"],
        ["perf", "write-bw", "-s", "18014398509481985M"],
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_softrdma"))
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            matches!(o.status.code(), Some(1 | 2))
                && (err.contains("should be between") || err.contains("must be between")),
            "{args:?}: {o:?}"
        );
    }
    // An address that binds but can't be a GID.
    let o = Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .args(["demo", "--addr", "224.0.0.1"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("unicast"),
        "{o:?}"
    );
}

#[test]
fn other_roce_ports_decode_when_asked() {
    // Rewrite the UDP destination port of every RoCEv2 frame from 4791 to 4792.
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = std::fs::read(data("rxe_send_lat.pcap")).unwrap();
    let mut n = 0;
    for i in 0..bytes.len() - 4 {
        // UDP header: ..., dst port 4791, length; IPv4 proto 17 sits 13 bytes before.
        if bytes[i..i + 2] == [0x12, 0xb7] && i >= 13 && bytes[i - 13] == 17 {
            bytes[i + 1] = 0xb8;
            n += 1;
        }
    }
    assert_eq!(n, 20);
    let p = write_temp(&dir, "port.pcap", &bytes);
    let o = decode(&[], &p);
    assert!(stdout(&o).contains("0 RoCEv2 packets"));
    let o = decode(&["--roce-port", "4792"], &p);
    let out = stdout(&o);
    assert!(out.contains("20 RoCEv2 packets"), "{out}");
    // The port is inside the ICRC: every packet now fails its check.
    assert_eq!(errors(&o), 20);
}

#[test]
fn the_demo_verifies_every_operation() {
    let o = Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .args(["demo", "--addr", "127.0.0.1"])
        .output()
        .unwrap();
    let out = stdout(&o);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("all 37 operations verified"), "{out}");
    for op in [
        "SEND_WITH_IMM",
        "RDMA_WRITE_WITH_IMM",
        "RDMA_READ",
        "ATOMIC_CMP_AND_SWP",
        "ATOMIC_FETCH_AND_ADD",
    ] {
        assert!(
            out.lines().any(|l| l.starts_with(op) && l.contains("yes")),
            "{op}: {out}"
        );
    }
    assert!(out.contains("1048576  yes"), "{out}");
    let o = Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .args(["demo", "--addr", "0.0.0.0"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("specific IPv4 address"));
}

/// Runs a ping server and client on two loopback addresses; returns both outputs.
fn ping_pair(args: &[&str], server_ip: &str, client_ip: &str, tcp: &str) -> (Output, Output) {
    tool_pair(&["ping"], args, args, server_ip, client_ip, tcp)
}

/// A server and a client of `softrdma SUB...`, each with its own flags.
fn tool_pair(
    sub: &[&str],
    server_args: &[&str],
    client_args: &[&str],
    server_ip: &str,
    client_ip: &str,
    tcp: &str,
) -> (Output, Output) {
    let server: Vec<&str> = [sub, server_args, &["--bind", server_ip, "-p", tcp]].concat();
    let client: Vec<&str> = [
        sub,
        client_args,
        &["--bind", client_ip, "-p", tcp, server_ip],
    ]
    .concat();
    spawn_pair(&server, &client)
}

/// Starts `softrdma ARGS...` in the background, its output kept.
fn spawn_server(args: &[&str]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Starts `softrdma SERVER...`, then runs `softrdma CLIENT...` until it finds
/// the server listening; both outputs.
fn spawn_pair(server: &[&str], client: &[&str]) -> (Output, Output) {
    let bin = env!("CARGO_BIN_EXE_softrdma");
    let server = spawn_server(server);
    let mut out = None;
    for _ in 0..50 {
        std::thread::sleep(std::time::Duration::from_millis(100));
        let o = Command::new(bin).args(client).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).to_lowercase();
        if err.contains("couldn't connect")
            || err.contains("refused")
            || err.contains("nothing listens")
        {
            continue;
        }
        out = Some(o);
        break;
    }
    let client = out.expect("the server listened");
    let server = server.wait_with_output().unwrap();
    (server, client)
}

/// The "N iters in S seconds = U usec/iter" line's N and the bytes line's bytes.
fn ping_result(o: &Output) -> (u64, u64) {
    let out = stdout(o);
    let bytes = out
        .lines()
        .find(|l| l.contains(" bytes in "))
        .unwrap_or_else(|| panic!("{out}"));
    let iters = out
        .lines()
        .find(|l| l.contains(" iters in "))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        iters.ends_with("usec/iter") && bytes.ends_with("Mbit/sec"),
        "{out}"
    );
    (
        iters.split_whitespace().next().unwrap().parse().unwrap(),
        bytes.split_whitespace().next().unwrap().parse().unwrap(),
    )
}

#[test]
fn ping_rc_and_ud_between_two_processes() {
    for (args, size, ips, tcp) in [
        (
            vec!["-n", "300", "-s", "5000", "-c"],
            5000u64,
            ("127.0.1.1", "127.0.1.2"),
            "19310",
        ),
        (
            vec!["--ud", "-n", "300", "-s", "1000", "-c"],
            1000,
            ("127.0.1.3", "127.0.1.4"),
            "19311",
        ),
        (
            vec!["-n", "50", "-s", "64", "-e"],
            64,
            ("127.0.1.5", "127.0.1.6"),
            "19312",
        ),
    ] {
        let (s, c) = ping_pair(&args, ips.0, ips.1, tcp);
        for (who, o) in [("server", &s), ("client", &c)] {
            assert!(
                o.status.success(),
                "{who} {args:?}: {}{}",
                stdout(o),
                String::from_utf8_lossy(&o.stderr)
            );
            let n: u64 = args[args.iter().position(|a| *a == "-n").unwrap() + 1]
                .parse()
                .unwrap();
            assert_eq!(ping_result(o), (n, size * n * 2), "{who} {args:?}");
            assert!(!stdout(o).contains("invalid data"), "{who}: {}", stdout(o));
            assert!(
                stdout(o).contains("remote address: LID 0x0000, QPN 0x"),
                "{}",
                stdout(o)
            );
        }
    }
}

#[test]
fn ping_refuses_bad_options() {
    let bin = env!("CARGO_BIN_EXE_softrdma");
    let o = Command::new(bin)
        .args(["ping", "-m", "1000", "127.0.0.1"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("MTU must be"));
    let o = Command::new(bin)
        .args(["ping", "-n", "x"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let (s, c) = ping_pair(
        &["--ud", "-s", "5000", "-n", "1"],
        "127.0.1.7",
        "127.0.1.8",
        "19313",
    );
    assert!(!s.status.success() && !c.status.success());
    assert!(String::from_utf8_lossy(&c.stderr).contains("larger than port MTU"));
}

#[test]
fn devices_lists_loopback_with_its_ipv4_gid_at_index_1() {
    let o = Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .arg("devices")
        .output()
        .unwrap();
    assert!(o.status.success());
    let out = stdout(&o);
    let lo = out
        .lines()
        .find(|l| l.starts_with("roce_lo "))
        .expect("a roce_lo device");
    let cols: Vec<&str> = lo.split_whitespace().collect();
    assert_eq!(
        cols[..5],
        [
            "roce_lo",
            "1",
            "1",
            "0000:0000:0000:0000:0000:ffff:7f00:0001",
            "127.0.0.1"
        ]
    );
}

#[test]
fn ping_refuses_a_bad_device_or_gid_index() {
    let bin = env!("CARGO_BIN_EXE_softrdma");
    let o = Command::new(bin)
        .args(["ping", "-d", "nosuchdev0", "127.0.0.1"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("no device nosuchdev0") && err.contains("roce_lo"),
        "{err}"
    );
    let o = Command::new(bin)
        .args(["ping", "-d", "roce_lo", "-g", "0", "127.0.0.1"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("IPv6 link-local"));
    let o = Command::new(bin)
        .args(["ping", "-d", "roce_lo", "-g", "5", "127.0.0.1"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no GID index 5"));
}

#[test]
fn ping_writes_a_pcap_that_decodes_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let pcap = dir.path().join("client.pcap");
    let (s, c) = tool_pair(
        &["ping"],
        &["-n", "20", "-s", "5000"],
        &["-n", "20", "-s", "5000", "--pcap", pcap.to_str().unwrap()],
        "127.0.1.21",
        "127.0.1.22",
        "19321",
    );
    assert!(s.status.success() && c.status.success(), "{c:?}");
    let o = decode(&[], &pcap);
    assert!(o.status.success(), "{}", stdout(&o));
    assert_eq!(errors(&o), 0);
    // 20 messages of 5 packets (MTU 1024) each way, sent and received.
    let sends = stdout(&o)
        .lines()
        .filter(|l| l.contains("RC SEND_"))
        .count();
    assert!(sends >= 200, "{sends} SEND packets");
    assert!(stdout(&o).contains("127.0.1.22:"), "the client's packets");
}

/// perftest's table rows: the numeric lines.
fn perf_rows(o: &Output) -> Vec<Vec<f64>> {
    stdout(o)
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() >= 4 && f.iter().all(|x| x.parse::<f64>().is_ok()))
        .map(|f| f.iter().map(|x| x.parse().unwrap()).collect())
        .collect()
}

/// Both sides of a perf pair exited 0.
fn assert_both_succeeded(test: &str, s: &Output, c: &Output) {
    for (who, o) in [("server", s), ("client", c)] {
        assert!(
            o.status.success(),
            "{test} {who}: {}{}",
            stdout(o),
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

/// The client printed one result row, of the `-n` iterations of every QP
/// (`-q 2`, or one).
fn assert_one_row_of_every_iteration(what: &str, args: &[&str], c: &Output) {
    let n: f64 = args[args.iter().position(|a| *a == "-n").unwrap() + 1]
        .parse()
        .unwrap();
    let qps = if args.contains(&"-q") { 2.0 } else { 1.0 };
    let rows = perf_rows(c);
    assert_eq!(rows.len(), 1, "{what}: {}", stdout(c));
    assert_eq!(rows[0][1], n * qps, "{what}");
}

/// With --verify, the side where the data lands (the client for READs)
/// checked it.
fn assert_verified(test: &str, args: &[&str], s: &Output, c: &Output) {
    if args.contains(&"--verify") {
        let checked = if test.starts_with("read") { c } else { s };
        assert!(
            stdout(checked).contains("Payload check (--verify): OK"),
            "{test}: {}",
            stdout(checked)
        );
    }
}

#[test]
fn perf_runs_every_test_between_two_processes_with_verified_payload() {
    for (k, (test, extra)) in [
        ("write-bw", vec!["-s", "5000", "-q", "2"]),
        ("read-bw", vec!["-s", "70000"]),
        ("send-bw", vec!["-s", "3000"]),
        ("atomic-bw", vec![]),
        ("atomic-bw", vec!["-A", "CMP_AND_SWAP"]),
        ("write-lat", vec!["-s", "100"]),
        ("read-lat", vec!["-s", "100"]),
        ("send-lat", vec!["-s", "100"]),
        ("atomic-lat", vec![]),
    ]
    .into_iter()
    .enumerate()
    {
        let mut args = vec![test, "-n", "50"];
        // write-lat and atomic-lat move no payload worth checking.
        if !matches!(test, "write-lat" | "atomic-lat") {
            args.push("--verify");
        }
        args.extend(extra);
        let tcp = (19330 + k).to_string();
        let (s, c) = tool_pair(&["perf"], &args, &args, "127.0.1.31", "127.0.1.32", &tcp);
        assert_both_succeeded(test, &s, &c);
        let rows = perf_rows(&c);
        assert_eq!(rows.len(), 1, "{test}: {}", stdout(&c));
        let size = match test {
            t if t.starts_with("atomic") => 8.0,
            _ => args[args.iter().position(|a| *a == "-s").unwrap() + 1]
                .parse()
                .unwrap(),
        };
        // BW rows count the iterations of all QPs, as perftest's.
        let qps = if args.contains(&"-q") { 2.0 } else { 1.0 };
        assert_eq!((rows[0][0], rows[0][1]), (size, 50.0 * qps), "{test}");
        assert!(
            rows[0][2..].iter().all(|v| *v >= 0.0) && rows[0][3] > 0.0,
            "{test}"
        );
        assert_verified(test, &args, &s, &c);
    }
}

/// The values of a "#, usec" list: "N, time" lines after each header.
fn listed_times(out: &str) -> Vec<Vec<f64>> {
    let mut lists: Vec<Vec<f64>> = Vec::new();
    for line in out.lines() {
        if line == "#, usec" {
            lists.push(Vec::new());
        } else if let (Some(list), Some((n, t))) = (lists.last_mut(), line.split_once(", ")) {
            assert_eq!(n.parse::<usize>().unwrap(), list.len() + 1, "{line}");
            list.push(t.parse().unwrap());
        }
    }
    lists
}

#[test]
fn perf_lists_every_iteration_with_u_and_h() {
    let args = ["write-lat", "-n", "40", "-U", "-H"];
    let (s, c) = tool_pair(&["perf"], &args, &args, "127.0.1.61", "127.0.1.62", "19360");
    assert_both_succeeded("write-lat -U -H", &s, &c);
    let lists = listed_times(&stdout(&c));
    // The times between 40 posts: in order (-U), then sorted (-H).
    assert_eq!(lists.len(), 2, "{}", stdout(&c));
    let (unsorted, sorted) = (&lists[0], &lists[1]);
    assert_eq!(unsorted.len(), 39);
    let mut want = unsorted.clone();
    want.sort_by(f64::total_cmp);
    assert_eq!(sorted, &want);
    // The summary's t_min is the sorted list's first.
    let rows = perf_rows(&c);
    assert_eq!(rows.len(), 1);
    assert!(
        (rows[0][2] - sorted[0]).abs() < 0.006,
        "{} {}",
        rows[0][2],
        sorted[0]
    );
    assert_eq!(listed_times(&stdout(&s)).len(), 2, "the server lists too");
}

#[test]
fn perf_over_iwarp_with_rdma_cm_between_two_processes() {
    // -R: a control connection for the exchange, then the data QPs, all
    // through one MPA listener. send-bw with 6 receives and 300 messages
    // only passes if the sender keeps to the receiver's credits (iWARP has
    // no RNR: one SEND too many ends the connection).
    for (k, (test, extra)) in [
        ("write-bw", vec!["-s", "5000", "-q", "2", "--verify"]),
        ("read-bw", vec!["-s", "70000", "--verify"]),
        (
            "send-bw",
            vec!["-s", "3000", "-r", "6", "-n", "300", "--verify"],
        ),
        ("write-lat", vec!["-s", "100"]),
        ("send-lat", vec!["-s", "100", "--verify"]),
    ]
    .into_iter()
    .enumerate()
    {
        let mut args = vec![test, "-R"];
        if !extra.contains(&"-n") {
            args.extend(["-n", "50"]);
        }
        args.extend(extra);
        let tcp = (19370 + k).to_string();
        let (s, c) = tool_pair(&["perf"], &args, &args, "127.0.1.33", "127.0.1.34", &tcp);
        assert_both_succeeded(test, &s, &c);
        for o in [&s, &c] {
            assert!(stdout(o).contains("Data ex. method : rdma_cm"), "{test}");
        }
        assert_one_row_of_every_iteration(test, &args, &c);
        assert_verified(test, &args, &s, &c);
    }
}

#[test]
fn perf_over_roce_with_rdma_cm_between_two_processes() {
    // -R --provider roce: the IB CM on QP 1 (REQ, REP, RTU) for the control
    // connection and each RC data QP, SIDR for UD ones; the devices on UDP
    // port 4791.
    for (k, (test, extra)) in [
        ("write-bw", vec!["-s", "5000", "-q", "2", "--verify"]),
        ("read-bw", vec!["-s", "70000", "--verify"]),
        (
            "send-bw",
            vec!["-s", "3000", "-r", "6", "-n", "300", "--verify"],
        ),
        ("atomic-bw", vec!["--verify"]),
        ("read-lat", vec!["-s", "100", "--verify"]),
        // UD: the data QPs found by SIDR; a latency test's client first
        // sends the server its address.
        (
            "send-bw",
            vec!["-c", "UD", "-s", "1000", "-q", "2", "-n", "200", "--verify"],
        ),
        ("send-lat", vec!["-c", "UD", "-s", "64", "--verify"]),
    ]
    .into_iter()
    .enumerate()
    {
        let mut args = vec![test, "-R", "--provider", "roce"];
        if !extra.contains(&"-n") {
            args.extend(["-n", "50"]);
        }
        args.extend(extra);
        let tcp = (19380 + k).to_string();
        let (s, c) = tool_pair(&["perf"], &args, &args, "127.0.1.35", "127.0.1.36", &tcp);
        assert_both_succeeded(test, &s, &c);
        for o in [&s, &c] {
            assert!(stdout(o).contains("Data ex. method : rdma_cm"), "{test}");
            assert!(stdout(o).contains("Transport type : IB"), "{test}");
        }
        assert_one_row_of_every_iteration(test, &args, &c);
        assert_verified(test, &args, &s, &c);
    }
}

#[test]
fn perf_over_roce_with_rdma_cm_finds_a_stopped_peer_at_the_end_barrier() {
    // The server of a WRITE test waits on its control QP for the client's
    // end of the run. A client stopped mid-run (as a host gone) is found by
    // the server's probes, not waited for until the run's 30 s are over.
    let bin = env!("CARGO_BIN_EXE_softrdma");
    let common = [
        "perf",
        "write-bw",
        "-R",
        "--provider",
        "roce",
        "-D",
        "30",
        "-p",
        "19395",
    ];
    let mut server = spawn_server(&[&common[..], &["--bind", "127.0.1.91"]].concat());
    let mut client = None;
    for _ in 0..30 {
        std::thread::sleep(std::time::Duration::from_millis(200));
        let mut c = Command::new(bin)
            .args([&common[..], &["--bind", "127.0.1.92", "127.0.1.91"]].concat())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Stopped only once its traffic runs (the table's header printed):
        // the server waits at its end barrier then. A client that finds
        // nobody listening ends, and is started again.
        let out = c.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if line.contains("#bytes") && tx.send(()).is_err() {
                    break;
                }
            }
        });
        if rx.recv_timeout(std::time::Duration::from_secs(20)).is_ok() {
            client = Some(c);
            break;
        }
        let _ = c.kill();
        let _ = c.wait();
    }
    let mut client = client.expect("the client connected and ran");
    let stopped = Command::new("kill")
        .args(["-STOP", &client.id().to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    let since = std::time::Instant::now();
    let limit = std::time::Duration::from_secs(25);
    while server.try_wait().unwrap().is_none() && since.elapsed() < limit {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let took = since.elapsed();
    let _ = server.kill();
    let _ = client.kill();
    let _ = client.wait();
    let server = server.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&server.stderr);
    assert!(
        took < limit,
        "the server still waited after {took:?}: {err}"
    );
    assert_eq!(server.status.code(), Some(1), "{err}");
    assert!(err.contains("stopped answering on the control QP"), "{err}");
}

#[test]
fn perf_over_shared_memory_between_two_processes() {
    for (k, (test, extra)) in [
        ("write-bw", vec!["-s", "70000", "-q", "2", "--verify"]),
        ("read-bw", vec!["-s", "5000", "--verify"]),
        ("send-bw", vec!["-s", "3000", "--verify"]),
        ("atomic-bw", vec!["--verify"]),
        ("write-lat", vec!["-s", "8"]),
        ("read-lat", vec!["-s", "8", "--verify"]),
        ("atomic-lat", vec![]),
    ]
    .into_iter()
    .enumerate()
    {
        let mut args = vec![test, "--provider", "shm", "-n", "200"];
        args.extend(extra);
        let tcp = (19380 + k).to_string();
        let (s, c) = tool_pair(&["perf"], &args, &args, "127.0.1.35", "127.0.1.36", &tcp);
        assert_both_succeeded(test, &s, &c);
        for o in [&s, &c] {
            assert!(stdout(o).contains("Transport type : SHM"), "{test}");
        }
        let rows = perf_rows(&c);
        let qps = if args.contains(&"-q") { 2.0 } else { 1.0 };
        assert_eq!(rows.len(), 1, "{test}: {}", stdout(&c));
        assert_eq!(rows[0][1], 200.0 * qps, "{test}");
        assert_verified(test, &args, &s, &c);
    }
}

/// A send_bw server whose few messages all land before its first poll
/// times them from when it began to wait, not over no time at all (it
/// printed 5000 Mpps for five 8-byte SENDs).
#[test]
fn a_send_bw_server_times_a_few_messages_sensibly() {
    for k in 0..3 {
        let args = ["send-bw", "--provider", "shm", "-s", "8", "-n", "5"];
        let tcp = (19420 + k).to_string();
        let (s, c) = tool_pair(&["perf"], &args, &args, "127.0.1.73", "127.0.1.74", &tcp);
        assert_both_succeeded("send-bw -n 5", &s, &c);
        let rows = perf_rows(&s);
        assert_eq!(rows.len(), 1, "{}", stdout(&s));
        assert_eq!(rows[0][1], 5.0, "the iterations");
        // Shared memory moves tens of millions of 8-byte SENDs a second.
        let mpps = rows[0][4];
        assert!(mpps > 0.0 && mpps < 1000.0, "{mpps} Mpps: {}", stdout(&s));
    }
}

/// `--use-srq`: the receiving QPs share one SRQ of rx-depth receives. With
/// two QPs and 6 or 8 receives, a QP's messages land in receives the other
/// posted, the receives are refilled as they are used, and the iWARP
/// sender keeps to its QP's share (a SEND too many ends the connection).
#[test]
fn perf_send_tests_with_a_shared_receive_queue() {
    for (k, args) in [
        vec!["send-bw", "-q", "2", "-s", "3000", "-n", "300", "-r", "8"],
        vec![
            "send-bw", "-R", "-q", "2", "-s", "3000", "-n", "300", "-r", "6",
        ],
        // A share of one receive per QP; messages small enough to step
        // through the buffer, so that they land at another QP's steps.
        vec![
            "send-bw", "-R", "-q", "2", "-s", "64", "-n", "200", "-r", "2",
        ],
        vec!["send-bw", "-q", "2", "-s", "64", "-n", "300", "-r", "8"],
        vec!["send-bw", "-b", "-q", "2", "-s", "3000", "-n", "100"],
        vec!["send-bw", "-c", "UD", "-s", "1000", "-n", "50"],
        vec!["send-lat", "-s", "100", "-n", "50"],
        vec!["send-lat", "-R", "-s", "100", "-n", "50"],
    ]
    .into_iter()
    .enumerate()
    {
        let mut args = args;
        args.extend(["--use-srq", "--verify"]);
        let tcp = (19400 + k).to_string();
        let (s, c) = tool_pair(&["perf"], &args, &args, "127.0.1.37", "127.0.1.38", &tcp);
        assert_both_succeeded(args[0], &s, &c);
        for o in [&s, &c] {
            assert!(stdout(o).contains("Using SRQ      : ON"), "{args:?}");
        }
        assert_one_row_of_every_iteration(&format!("{args:?}"), &args, &c);
        assert!(
            stdout(&s).contains("Payload check (--verify): OK"),
            "{args:?}: {}",
            stdout(&s)
        );
    }
}

#[test]
fn perf_refuses_bad_flags_as_perftest_does() {
    let bin = env!("CARGO_BIN_EXE_softrdma");
    for (args, msg) in [
        (
            vec!["perf", "atomic-bw", "-s", "16"],
            "cannot be changed for Atomic",
        ),
        (
            vec!["perf", "write-bw", "-A", "CMP_AND_SWAP"],
            "-A is for the atomic",
        ),
        (
            vec!["perf", "atomic-bw", "-A", "XOR"],
            "Invalid Atomic type",
        ),
        (vec!["perf", "write-lat", "-q", "2"], "Multiple QPs"),
        (
            vec!["perf", "read-bw", "-I", "64"],
            "Inline feature not available",
        ),
        (vec!["perf", "write-bw", "-n", "2"], "Iteration num"),
        (
            vec!["perf", "write-bw", "-c", "UD"],
            "only possible in SEND tests",
        ),
        (vec!["perf", "write-bw", "-c", "XRC"], "runs RC and UD"),
        (vec!["perf", "atomic-lat", "--verify"], "--verify checks"),
        (
            vec!["perf", "write-bw", "-d", "roce_lo", "-x", "0"],
            "IPv6 link-local",
        ),
        (vec!["perf", "atomic-bw", "-R"], "no atomics"),
        (
            vec!["perf", "send-bw", "--provider", "shm", "-c", "UD"],
            "RC QPs only",
        ),
        (
            vec!["perf", "write-bw", "--provider", "shm", "-R"],
            "not rdma_cm",
        ),
        (
            vec!["perf", "write-bw", "--use-srq"],
            "only avavilible in SEND",
        ),
        (
            vec!["perf", "send-bw", "--use-srq", "-q", "4", "-r", "2"],
            "greater than number of QPs",
        ),
        (
            vec!["perf", "send-bw", "--use-srq", "--provider", "shm"],
            "no shared receive queues",
        ),
        (vec!["perf", "send-bw", "-R", "-c", "UD"], "iWARP has no UD"),
        (
            vec![
                "perf",
                "write-bw",
                "-R",
                "--provider",
                "roce",
                "--shared-port",
            ],
            "UDP port 4791",
        ),
        (vec!["perf", "send-bw", "-R", "-b"], "not implemented"),
        (
            vec!["perf", "write-bw", "-R", "--pcap", "/tmp/x.pcap"],
            "not -R",
        ),
        (vec!["perf", "write-bw", "-H"], "bandwidth tests have none"),
        (vec!["perf", "write-lat", "-U", "-D", "2"], "not a duration"),
    ] {
        assert_refused(&args, 1, msg);
    }
    let o = Command::new(bin)
        .args(["perf", "write-bw", "-s", "0"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    // Out of perftest's ranges, or a port no peer can reach: refused by the
    // parser, before anything listens.
    for args in [
        ["perf", "write-bw", "-t", "0"],
        ["perf", "write-bw", "-t", "15001"],
        ["perf", "write-bw", "-Q", "0"],
        ["perf", "write-bw", "-Q", "1025"],
        ["perf", "write-bw", "-q", "0"],
        ["perf", "write-bw", "-q", "16385"],
        ["perf", "send-bw", "-r", "0"],
        ["perf", "write-bw", "-p", "0"],
        ["ping", "--udp-port", "0", "127.0.0.1"],
    ] {
        assert_refused(&args, 2, "invalid value");
    }
}

/// `softrdma ARGS...` exits with `code` and says `says` on stderr.
fn assert_refused(args: &[&str], code: i32, says: &str) {
    let o = Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .args(args)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(code), "{args:?}: {o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(says), "{args:?}: {err}");
}

/// `softrdma udaddy` in both roles (rdma_cm's SIDR, then SENDs with
/// immediate both ways), with one and two connections; a message larger
/// than the path MTU is refused.
#[test]
fn udaddy_between_two_processes() {
    for (k, extra) in [vec![], vec!["-c", "2", "-C", "30", "-S", "2000"]]
        .into_iter()
        .enumerate()
    {
        let port = (7300 + k).to_string();
        let common = [&["udaddy", "--port", port.as_str()][..], &extra].concat();
        let server = [&common[..], &["-b", "127.0.1.81"]].concat();
        let client = [&common[..], &["-s", "127.0.1.81", "-b", "127.0.1.82"]].concat();
        let (s, c) = spawn_pair(&server, &client);
        assert_both_succeeded("udaddy", &s, &c);
        for (o, want) in [
            (&s, &["receiving data transfers", "sending replies"]),
            (
                &c,
                &["initiating data transfers", "receiving data transfers"],
            ),
        ] {
            let out = stdout(o);
            let mut at = 0;
            for w in want
                .iter()
                .chain(&["data transfers complete", "return status 0"])
            {
                at += out[at..]
                    .find(w)
                    .unwrap_or_else(|| panic!("{w:?} in {out}"))
                    + w.len();
            }
        }
    }
    let o = Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .args(["udaddy", "-b", "127.0.1.83", "-S", "5000"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("larger than the path MTU"));
    assert!(stdout(&o).contains("return status 1"));
}

/// Two sides that disagree on the number of QPs find out in the handshake,
/// both fail with a message, and neither reads the other's key as a report.
#[test]
fn perf_sides_with_different_numbers_of_qps_fail_in_the_handshake() {
    for (k, (server_qps, client_qps)) in [("1", "2"), ("2", "1")].into_iter().enumerate() {
        let tcp = (19390 + k).to_string();
        let (s, c) = tool_pair(
            &["perf"],
            &["write-bw", "-n", "50", "-s", "4096", "-q", server_qps],
            &["write-bw", "-n", "50", "-s", "4096", "-q", client_qps],
            "127.0.1.71",
            "127.0.1.72",
            &tcp,
        );
        assert_eq!(s.status.code(), Some(1), "server: {s:?}");
        assert_eq!(c.status.code(), Some(1), "client: {c:?}");
        let said = [&s, &c].map(|o| String::from_utf8_lossy(&o.stderr).into_owned());
        assert!(said.iter().any(|e| e.contains("the same -q")), "{said:?}");
        assert!(perf_rows(&s).is_empty() && perf_rows(&c).is_empty());
    }
}

#[test]
fn perf_a_send_test_against_a_write_test_fails_within_seconds() {
    // The WRITE server posts no receives: the client's SENDs draw RNR NAKs,
    // which rnr_retry 7 retries for good. The client says so after 10 s.
    let started = std::time::Instant::now();
    let (s, c) = tool_pair(
        &["perf"],
        &["write-bw", "-n", "50", "-s", "4096"],
        &["send-bw", "-n", "50", "-s", "4096"],
        "127.0.1.93",
        "127.0.1.94",
        "19396",
    );
    let took = started.elapsed();
    let said = [&s, &c].map(|o| String::from_utf8_lossy(&o.stderr).into_owned());
    assert_eq!(c.status.code(), Some(1), "{said:?}");
    assert!(said[1].contains("RNR NAKs"), "{said:?}");
    assert_eq!(s.status.code(), Some(1), "{said:?}");
    assert!(
        said[0].contains("the peer closed the connection"),
        "{said:?}"
    );
    assert!(took < std::time::Duration::from_secs(30), "{took:?}");
}

#[test]
fn perf_duration_mode_and_ud_and_bidirectional_between_two_processes() {
    for (k, args) in [
        vec!["write-bw", "-D", "1", "-s", "4096"],
        vec!["send-bw", "-D", "1", "-s", "4096"],
        vec!["send-lat", "-D", "1"],
        vec!["write-lat", "-D", "1"],
        vec!["send-bw", "-c", "UD", "-s", "1000", "-n", "50", "--verify"],
        vec!["send-lat", "-c", "UD", "-s", "100", "-n", "50"],
        vec!["write-bw", "-b", "-s", "3000", "-n", "50", "--verify"],
        vec!["send-bw", "-b", "-s", "3000", "-n", "50", "--verify"],
    ]
    .into_iter()
    .enumerate()
    {
        let tcp = (19350 + k).to_string();
        let (s, c) = tool_pair(&["perf"], &args, &args, "127.0.1.41", "127.0.1.42", &tcp);
        for (who, o) in [("server", &s), ("client", &c)] {
            assert!(
                o.status.success(),
                "{args:?} {who}: {}{}",
                stdout(o),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        let rows = perf_rows(&c);
        assert_eq!(rows.len(), 1, "{args:?}: {}", stdout(&c));
        assert!(
            rows[0][1] > 0.0 && rows[0][3] > 0.0,
            "{args:?}: {:?}",
            rows[0]
        );
        if args.contains(&"-b") {
            // Both sides print the same summed figures, and both checked.
            assert_eq!(perf_rows(&s), rows, "{args:?}");
            assert!(stdout(&s).contains("Bidirectional BW Test"));
        }
        if args.contains(&"--verify") {
            assert!(
                stdout(&s).contains("Payload check (--verify): OK"),
                "{args:?}"
            );
        }
    }
}

#[test]
fn rping_between_two_processes_over_iwarp() {
    let (s, c) = spawn_pair(
        &[
            "rping",
            "-s",
            "-a",
            "127.0.1.51",
            "-p",
            "19361",
            "-S",
            "5000",
            "-v",
        ],
        &[
            "rping",
            "-c",
            "-a",
            "127.0.1.51",
            "-I",
            "127.0.1.52",
            "-p",
            "19361",
            "-C",
            "7",
            "-S",
            "5000",
            "-v",
            "-V",
            "--crc",
            "-t",
            "0x20",
            "-q",
        ],
    );
    assert!(c.status.success() && s.status.success(), "{c:?} {s:?}");
    let pings: Vec<String> = stdout(&c)
        .lines()
        .filter_map(|l| l.strip_prefix("ping data: ").map(str::to_string))
        .collect();
    assert_eq!(pings.len(), 7);
    for (k, p) in pings.iter().enumerate() {
        assert!(p.starts_with(&format!("rdma-ping-{k}: ")), "{p}");
        assert_eq!(p.len(), 4999, "the whole buffer but its NUL came back");
    }
    assert_eq!(
        stdout(&s)
            .lines()
            .filter(|l| l.starts_with("server ping data: "))
            .count(),
        7
    );
    assert!(String::from_utf8_lossy(&s.stderr).contains("DISCONNECT"));
}

#[test]
fn rping_between_two_processes_over_roce() {
    let (s, c) = spawn_pair(
        &[
            "rping",
            "--roce",
            "-s",
            "-a",
            "127.0.1.54",
            "-p",
            "19363",
            "-S",
            "3000",
            "-v",
        ],
        &[
            "rping",
            "--roce",
            "-c",
            "-a",
            "127.0.1.54",
            "-I",
            "127.0.1.55",
            "-p",
            "19363",
            "-C",
            "4",
            "-S",
            "3000",
            "-v",
            "-V",
        ],
    );
    assert!(c.status.success() && s.status.success(), "{c:?} {s:?}");
    let pings: Vec<String> = stdout(&c)
        .lines()
        .filter_map(|l| l.strip_prefix("ping data: ").map(str::to_string))
        .collect();
    assert_eq!(pings.len(), 4);
    for (k, p) in pings.iter().enumerate() {
        assert!(p.starts_with(&format!("rdma-ping-{k}: ")), "{p}");
        assert_eq!(p.len(), 2999, "the whole buffer but its NUL came back");
    }
    // The server ends at the client's DREQ.
    assert!(String::from_utf8_lossy(&s.stderr).contains("DISCONNECT"));
    assert_eq!(
        stdout(&s)
            .lines()
            .filter(|l| l.starts_with("server ping data: "))
            .count(),
        4
    );
}

#[test]
fn rping_with_a_wrong_rkey_fails_with_the_terminate_reported() {
    let (s, c) = spawn_pair(
        &["rping", "-s", "-a", "127.0.1.53", "-p", "19362"],
        &[
            "rping",
            "-c",
            "-a",
            "127.0.1.53",
            "-I",
            "127.0.1.54",
            "-p",
            "19362",
            "-C",
            "1",
            "--bad-rkey",
        ],
    );
    assert!(!c.status.success() && !s.status.success());
    // The client's responder refused the server's READ with the wrong STag.
    assert!(
        String::from_utf8_lossy(&c.stderr)
            .contains("Terminate sent: layer 1 type 1 code 0x00 (DDP tagged: invalid STag)"),
        "{c:?}"
    );
    assert!(
        String::from_utf8_lossy(&s.stderr).contains("remote access error"),
        "{s:?}"
    );
}

/// `rping -s -P` keeps serving after a client that isn't one (as rdma-core's
/// does): an HTTP request on its port, then a real client; and one that
/// connects and says nothing holds the real client up for none of the ten
/// seconds it is given to speak.
#[test]
fn a_persistent_rping_server_outlives_a_bad_client() {
    use std::io::Write;
    let bin = env!("CARGO_BIN_EXE_softrdma");
    let mut server = spawn_server(&[
        "rping",
        "-s",
        "-P",
        "-a",
        "127.0.1.53",
        "-p",
        "19363",
        "-S",
        "100",
    ]);
    let mut bad = None;
    for _ in 0..50 {
        std::thread::sleep(std::time::Duration::from_millis(100));
        if let Ok(s) = std::net::TcpStream::connect("127.0.1.53:19363") {
            bad = Some(s);
            break;
        }
    }
    let mut bad = bad.expect("the server listened");
    bad.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    drop(bad);
    let silent = std::net::TcpStream::connect("127.0.1.53:19363").unwrap();
    let started = std::time::Instant::now();
    let client = Command::new(bin)
        .args([
            "rping",
            "-c",
            "-a",
            "127.0.1.53",
            "-I",
            "127.0.1.54",
            "-p",
            "19363",
            "-C",
            "2",
            "-S",
            "100",
            "-v",
        ])
        .output()
        .unwrap();
    let took = started.elapsed();
    let _ = server.kill();
    let server = server.wait_with_output().unwrap();
    drop(silent);
    assert!(client.status.success(), "{client:?} {server:?}");
    assert!(took < std::time::Duration::from_secs(5), "{took:?}");
    assert_eq!(
        stdout(&client)
            .lines()
            .filter(|l| l.starts_with("ping data: "))
            .count(),
        2
    );
    assert!(
        String::from_utf8_lossy(&server.stderr).contains("connection refused"),
        "{server:?}"
    );
}

/// `--provider ibverbs` (and `demo --ibverbs`) need a libibverbs device by
/// name; a wrong one fails at once, before any exchange, saying why.
#[test]
fn ibverbs_devices_are_named_and_checked() {
    assert_refused(
        &["perf", "write-bw", "--provider", "ibverbs"],
        1,
        "needs -d",
    );
    assert_refused(&["ping", "--provider", "ibverbs"], 1, "needs -d");
    assert_refused(
        &[
            "perf",
            "send-bw",
            "--provider",
            "ibverbs",
            "-d",
            "rxe0",
            "-R",
            "-c",
            "UD",
        ],
        1,
        "no rdma_cm UD mode",
    );
    assert_refused(
        &[
            "rping",
            "-s",
            "-a",
            "127.0.0.1",
            "--ibverbs",
            "rxe0",
            "--roce",
        ],
        2,
        "cannot be used with",
    );
    assert_refused(
        &[
            "ping",
            "--provider",
            "ibverbs",
            "-d",
            "rxe0",
            "--pcap",
            "/dev/null",
        ],
        1,
        "not --provider ibverbs",
    );
    for args in [
        &["perf", "write-bw", "--provider", "ibverbs", "-d", "nosuch0"][..],
        &[
            "ping",
            "--provider",
            "ibverbs",
            "-d",
            "nosuch0",
            "127.0.0.1",
        ],
        &["demo", "--ibverbs", "nosuch0"],
        &["rping", "-s", "-a", "127.0.0.1", "--ibverbs", "nosuch0"],
        &[
            "perf",
            "write-bw",
            "--provider",
            "ibverbs",
            "-d",
            "nosuch0",
            "-R",
        ],
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_softrdma"))
            .args(args)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("no RDMA device nosuch0") || err.contains("cannot load libibverbs"),
            "{args:?}: {err}"
        );
    }
}
