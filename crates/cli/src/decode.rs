//! `softrdma decode`: a capture's RoCEv2 and iWARP traffic, one line per unit.

use std::io::{self, Write};
use std::path::Path;
use std::process::ExitCode;

use softrdma::capture::{self, Decoder, Record};

#[derive(Debug, Default)]
struct Counts {
    frames: u64,
    roce: u64,
    iwarp: u64,
    errors: u64,
}

fn line(out: &mut impl Write, rec: &Record<'_>, t0: f64, quiet: bool, counts: &mut Counts) {
    match rec {
        Record::Roce(_) => counts.roce += 1,
        Record::Iwarp(_) => counts.iwarp += 1,
        Record::Problem(_) => {}
    }
    let errors = rec.errors();
    counts.errors += errors.len() as u64;
    if quiet && errors.is_empty() {
        return;
    }
    let time = if rec.time() > 0.0 {
        rec.time() - t0
    } else {
        0.0
    };
    let addrs = rec.endpoints().map_or_else(String::new, |e| e.to_string());
    let mut s = format!("{:6} {:11.6}  {addrs:<45}  ", rec.frame(), time);
    if !matches!(rec, Record::Problem(_)) {
        // A problem's description is its one error: said once, after "!!".
        s.push_str(&rec.describe());
        s.push_str("  ");
    }
    for e in &errors {
        s.push_str(&format!("!! {e}  "));
    }
    put(out, s.trim_end());
}

/// One line of output; a failed write ends the tool (quietly if the reader
/// went away, as `decode ... | head` does).
fn put(out: &mut impl Write, s: &str) {
    if let Err(e) = writeln!(out, "{s}") {
        crate::output_failed(e);
    }
}

pub fn run(path: &Path, roce_ports: &[u16], quiet: bool) -> ExitCode {
    // A capture is a file: a device or a pipe (/dev/zero) could be read
    // into memory without end.
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => {
            eprintln!(
                "softrdma decode: {} is not a regular file (a pcap or pcapng capture)",
                path.display()
            );
            return ExitCode::FAILURE;
        }
        _ => {}
    }
    let file = match std::fs::read(path) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("softrdma decode: cannot read {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    };
    let frames = match capture::frames(&file) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("softrdma decode: {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    };
    let mut decoder = Decoder::new();
    for &p in roce_ports {
        decoder.add_roce_port(p);
    }
    let stdout = io::stdout();
    let mut out = io::BufWriter::new(stdout.lock());
    let mut counts = Counts::default();
    let mut t0 = None;
    let mut capture_error = None;
    for frame in frames {
        match frame {
            Ok(frame) => {
                counts.frames += 1;
                let start = *t0.get_or_insert(frame.time);
                decoder.push(&frame, &mut |rec| {
                    line(&mut out, &rec, start, quiet, &mut counts)
                });
            }
            Err(e) => capture_error = Some(e),
        }
    }
    let start = t0.unwrap_or(0.0);
    decoder.finish(counts.frames, &mut |rec| {
        line(&mut out, &rec, start, quiet, &mut counts)
    });
    if let Some(e) = &capture_error {
        counts.errors += 1;
        put(&mut out, &format!("!! {e}"));
    }
    put(
        &mut out,
        &format!(
            "{}: {} frames, {} RoCEv2 packets, {} iWARP units decoded; {} error{}",
            path.display(),
            counts.frames,
            counts.roce,
            counts.iwarp,
            counts.errors,
            if counts.errors == 1 { "" } else { "s" }
        ),
    );
    if let Err(e) = out.flush() {
        crate::output_failed(e);
    }
    if counts.errors == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
