//! perftest's output: header, addresses, and the result tables, with its
//! formulas (`perftest_parameters.c`: print_report_bw, print_report_lat).

use std::time::Duration;

pub const RESULT_LINE: &str =
    "---------------------------------------------------------------------------------------";

/// C's `%#0Nx`: zero-padded to N, with "0x" only when the value is not zero.
pub fn c_alt_hex(v: u64, width: usize) -> String {
    if v == 0 {
        format!("{:0width$}", 0)
    } else {
        format!("{v:#0width$x}")
    }
}

/// perftest's GID line: the 16 bytes in decimal.
pub fn gid_line(gid: &[u8; 16]) -> String {
    let parts: Vec<String> = gid.iter().map(|b| format!("{b:02}")).collect();
    format!(" GID: {}", parts.join(":"))
}

pub fn bw_header(gbits: bool) -> String {
    let unit = if gbits { "Gb/sec" } else { "MB/sec" };
    format!(" #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]")
}

/// One bandwidth row (values already in the header's unit).
pub fn bw_row(size: u64, iters: u64, peak: f64, avg: f64, rate: f64, gbits: bool) -> String {
    if gbits && avg < 0.1 {
        format!(
            " {size:<7}    {iters}           {peak:<7.6}            {avg:<7.6}            {rate:<7.6}"
        )
    } else {
        format!(
            " {size:<7}    {iters:<10}       {peak:<7.2}            {avg:<7.2}\t\t   {rate:<7.6}"
        )
    }
}

/// Bytes per second in the unit of the table (MiB/s, or Gb/s).
pub fn bw_unit(bytes_per_sec: f64, gbits: bool) -> f64 {
    if gbits {
        bytes_per_sec / 125_000_000.0
    } else {
        bytes_per_sec / 1_048_576.0
    }
}

pub const LAT_HEADER: &str = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ";

pub const LAT_DURATION_HEADER: &str = " #bytes        #iterations       t_avg[usec]    tps average";

pub fn lat_duration_row(size: u64, iters: u64, avg: f64, tps: f64) -> String {
    format!(" {size:<7}       {iters}            {avg:<7.2}        {tps:<7.2}")
}

/// Latency statistics from the times between consecutive posts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatStats {
    pub min: f64,
    pub max: f64,
    pub typical: f64,
    pub avg: f64,
    pub stdev: f64,
    pub p99: f64,
    pub p999: f64,
}

/// perftest's latency figures: `deltas` (µs, one way) sorted, the largest
/// two dropped for the median, mean and deviation; t_max is the largest
/// kept; the percentiles index the whole sorted list.
pub fn lat_stats(mut deltas: Vec<f64>) -> Option<LatStats> {
    deltas.sort_by(f64::total_cmp);
    let cnt = deltas.len().checked_sub(2).filter(|&c| c > 0)?;
    let kept = &deltas[..cnt];
    let typical = if cnt % 2 == 0 {
        (kept[cnt / 2] + kept[cnt / 2 - 1]) / 2.0
    } else {
        kept[cnt / 2]
    };
    let avg = kept.iter().sum::<f64>() / cnt as f64;
    let var = kept.iter().map(|d| (avg - d).powi(2)).sum::<f64>() / cnt as f64;
    let at = |q: f64| deltas[((cnt as f64 * q).ceil() as usize).min(deltas.len() - 1)];
    Some(LatStats {
        min: deltas[0],
        max: deltas[cnt],
        typical,
        avg,
        stdev: var.sqrt(),
        p99: at(0.99),
        p999: at(0.999),
    })
}

pub fn lat_row(size: u64, iters: u64, s: &LatStats) -> String {
    format!(
        " {size:<7} {iters}          {:<7.2}        {:<7.2}      {:<7.2}  \t       {:<7.2}     \t{:<7.2}\t\t{:<7.2} \t\t{:<7.2}",
        s.min, s.max, s.typical, s.avg, s.stdev, s.p99, s.p999
    )
}

/// Which lists of iteration times a latency test prints (perftest's -U, -H).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Listing {
    pub unsorted: bool,
    pub sorted: bool,
}

/// perftest's lists: "#, usec", then "N, time" per iteration, in the order
/// measured (-U), then sorted (-H).
pub fn write_lists(
    out: &mut impl std::io::Write,
    deltas: &[f64],
    list: Listing,
) -> std::io::Result<()> {
    let mut write = |d: &[f64]| -> std::io::Result<()> {
        writeln!(out, "#, usec")?;
        for (i, x) in d.iter().enumerate() {
            writeln!(out, "{}, {}", i + 1, c_g(*x))?;
        }
        Ok(())
    };
    if list.unsorted {
        write(deltas)?;
    }
    if list.sorted {
        let mut sorted = deltas.to_vec();
        sorted.sort_by(f64::total_cmp);
        write(&sorted)?;
    }
    Ok(())
}

/// C's `%g`: six significant digits, trailing zeros dropped, an exponent
/// when the rounded value's is below -4 or above 5 (C's rule: the
/// exponent is the one `%.5e` prints).
pub fn c_g(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let trim = |t: &str| -> String {
        if t.contains('.') {
            t.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            t.to_string()
        }
    };
    let e_form = format!("{x:.5e}");
    let (mantissa, exp) = e_form.split_once('e').unwrap_or((&e_form, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..6).contains(&exp) {
        let decimals = (5 - exp) as usize;
        trim(&format!("{x:.decimals$}"))
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{}e{sign}{:02}", trim(mantissa), exp.abs())
    }
}

/// The one-way (or whole, for READ and atomics) times between posts, in µs.
pub fn post_deltas(posted: &[quanta::Instant], halve: bool) -> Vec<f64> {
    posted
        .windows(2)
        .map(|w| {
            let d: Duration = w[1] - w[0];
            d.as_secs_f64() * 1e6 / if halve { 2.0 } else { 1.0 }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c_g_is_printfs_g() {
        // Values checked against C's printf("%g").
        for (x, want) in [
            (5.41, "5.41"),
            (4.4300001, "4.43"),
            (12.345678, "12.3457"),
            (0.0625, "0.0625"),
            (1234567.0, "1.23457e+06"),
            (0.00001234, "1.234e-05"),
            (100.0, "100"),
            (9.9999996, "10"),
            (0.0, "0"),
            (999999.5, "1e+06"),
            (0.00009999996, "0.0001"),
            (123456.7, "123457"),
            (1.0000005, "1"),
            (99.99995, "99.9999"),
        ] {
            assert_eq!(c_g(x), want, "{x}");
        }
    }

    #[test]
    fn lists_are_perftests() {
        let d = [3.0, 1.5, 2.25];
        let lines = |list| {
            let mut out = Vec::new();
            write_lists(&mut out, &d, list).unwrap();
            String::from_utf8(out).unwrap()
        };
        assert_eq!(lines(Listing::default()), "");
        let unsorted = Listing {
            unsorted: true,
            sorted: false,
        };
        assert_eq!(lines(unsorted), "#, usec\n1, 3\n2, 1.5\n3, 2.25\n");
        let both = Listing {
            unsorted: true,
            sorted: true,
        };
        assert_eq!(
            lines(both),
            "#, usec\n1, 3\n2, 1.5\n3, 2.25\n#, usec\n1, 1.5\n2, 2.25\n3, 3\n"
        );
    }

    #[test]
    fn c_alt_hex_is_cs() {
        assert_eq!(c_alt_hex(0, 4), "0000");
        assert_eq!(c_alt_hex(0x11, 6), "0x0011");
        assert_eq!(c_alt_hex(0x37d1a, 6), "0x37d1a");
        assert_eq!(c_alt_hex(0x2ab, 8), "0x0002ab");
    }

    #[test]
    fn rows_are_perftests() {
        assert_eq!(
            bw_row(65536, 5, 10.85, 10.85, 0.000174, false),
            " 65536      5                10.85              10.85  \t\t   0.000174"
        );
        assert_eq!(
            gid_line(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 255, 255, 10, 99, 0, 2]),
            " GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:99:00:02"
        );
    }

    #[test]
    fn lat_stats_follow_perftest() {
        // Ten deltas: the two largest are dropped for median/mean/stdev.
        let s = lat_stats(vec![5.0, 1.0, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0, 100.0, 200.0]).unwrap();
        assert_eq!(s.min, 1.0);
        assert_eq!(s.max, 100.0);
        assert_eq!(s.typical, 4.5);
        assert_eq!(s.avg, 4.5);
        // Percentiles index the whole list at ceil(kept * q): here the 9th.
        assert_eq!((s.p99, s.p999), (100.0, 100.0));
        assert!(lat_stats(vec![1.0, 2.0]).is_none());
    }
}
