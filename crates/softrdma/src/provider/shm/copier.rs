//! The copy helper: a thread that takes chunks of large shared-memory
//! copies ([`CopyBoard`]) while the posting thread copies the rest.
//!
//! A shared-memory WRITE or READ is one copy, made by the posting thread, and
//! one core's copy was that path's ceiling. A second core copying part of it
//! at the same time nearly doubles the rate where the data sits in cache.
//! The board keeps the copy sound and its last bytes last; this module
//! decides when the helper is there to help.
//!
//! - After a copy the helper spins for the next one (for [`SPIN_MIN`], longer
//!   after a larger copy). Meanwhile posters see it ready and post on the
//!   board; otherwise they copy alone and count the copy for it. Then it
//!   naps, for longer and longer, and spins again once a poster counted a
//!   copy; after [`PARK_AFTER`] with no copy to help with (sporadic copies
//!   come and go between its looks) it sleeps until a poster wakes it. A poster
//!   wakes it only for a copy large enough to pay for that, or for the second
//!   of two copies close together (a stream): waking a thread costs the
//!   waker 4–5 µs here, and the scheduler may queue the woken thread behind
//!   its waker for milliseconds, where a nap's timer wakes it on its own CPU.
//!   A poster never waits for the helper to come (see [`CopyBoard::copy`]).
//! - The helper helps only while the CPUs have room for it. Before it spins
//!   (at most every [`LOAD_EVERY`]) it counts the running tasks
//!   (`/proc/loadavg`, itself among them) and looks at how long it waited
//!   for a CPU since it last looked (its `schedstat`: sharing a CPU with its
//!   poster, it waits about half the time). More tasks than CPUs or a wait
//!   of more than [`WAITED_MAX`] of the time at two looks in a row (one look
//!   in a hundred meets a passing kernel thread), or a spin that lost its CPU, and
//!   it helps no copy for a while ([`BACKOFF_MIN`], doubling every few in a row up to
//!   [`BACKOFF_MAX`]); a nap's wake-up then finds it an idle CPU if there
//!   is one. It must not take a CPU from the application's threads (a
//!   latency test's two pollers, say), and a poster waits for a chunk its
//!   helper holds.
//! - Posters time one copy in [`SAMPLE_EVERY`], every other one of them
//!   made alone, and tell the helper to stay away for a while (from
//!   [`UNHELPFUL_MIN`], doubling while it goes on, up to [`UNHELPFUL_MAX`])
//!   when shared copies do not save a tenth of the time: on some hosts the
//!   two CPUs pass cache lines so slowly that shared 64 KiB copies ran at
//!   0.6 of one thread's.
//! - `SOFTRDMA_SHM_COPY_HELPER=0` turns it off: every copy is the poster's.

use std::borrow::Borrow;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::Thread;
use std::time::{Duration, Instant};

use crate::memory::{CopyBoard, Region, SHARE_MIN, Segment};

/// A sleeping helper is woken for a copy this large on its own.
const WAKE_MIN: usize = 2 << 20;
/// The helper spins for its next copy for at least [`SPIN_MIN`] and at most
/// [`SPIN_MAX`]; in between, a nanosecond per [`SPIN_BYTES_PER_NS`] bytes of
/// its last copy (a few times what the copy takes at 50–100 GB/s). Spins of
/// 2–4 µs lost `perf write-bw -s 65536` streams: a poll of the CQ or an
/// interrupt made a longer gap, the helper napped, and its timer woke it
/// at times on its poster's CPU. It spins only on a CPU nothing else
/// wants (see the module).
const SPIN_MIN: Duration = Duration::from_micros(20);
const SPIN_MAX: Duration = Duration::from_micros(100);
const SPIN_BYTES_PER_NS: usize = 16;
/// Its naps start at [`NAP_MIN`] and double up to [`NAP_MAX`].
const NAP_MIN: Duration = Duration::from_micros(20);
const NAP_MAX: Duration = Duration::from_millis(1);
/// With no copy to help with for this long, it sleeps until woken.
const PARK_AFTER: Duration = Duration::from_secs(1);
/// A spinning helper that went this long between two looks lost its CPU.
const PREEMPTED: Duration = Duration::from_micros(500);
/// How often a helper busy with copies looks at the CPUs' load.
const LOAD_EVERY: Duration = Duration::from_micros(100);
/// A helper that spent more than this share of its time waiting for a CPU
/// finds the CPUs busy.
const WAITED_MAX: f64 = 0.125;
/// How long a helper that found the CPUs busy helps no copy: from
/// [`BACKOFF_MIN`], doubling every [`BACKOFFS_TO_DOUBLE`] times in a row
/// that they are busy, up to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_millis(1);
const BACKOFF_MAX: Duration = Duration::from_millis(200);
const BACKOFFS_TO_DOUBLE: u32 = 4;

/// A poster times one copy in [`SAMPLE_EVERY`], every other one made
/// without the helper, and judges the help once it has [`SAMPLES`] of each.
const SAMPLE_EVERY: u32 = 32;
const SAMPLES: usize = 6;
/// Help that does not save this share of a copy's time does not pay.
const WORTH: f64 = 0.9;
/// How long a helper whose help did not pay stays away: from
/// [`UNHELPFUL_MIN`], doubling each time in a row, up to [`UNHELPFUL_MAX`].
const UNHELPFUL_MIN: Duration = Duration::from_millis(50);
const UNHELPFUL_MAX: Duration = Duration::from_secs(2);

fn spin_for(len: usize) -> Duration {
    Duration::from_nanos((len / SPIN_BYTES_PER_NS) as u64).clamp(SPIN_MIN, SPIN_MAX)
}

/// Chunks the helper has copied (for tests).
#[cfg(test)]
pub(super) static CHUNKS_HELPED: AtomicU64 = AtomicU64::new(0);

/// The process's helper.
struct Helper {
    board: CopyBoard,
    /// It watches the board: posters post there only then, and otherwise
    /// copy alone without the board's claims.
    ready: AtomicBool,
    /// Large copies made while it was not ready.
    missed: AtomicU64,
    /// Until when (nanoseconds since [`epoch`]) it stays away: posters
    /// timed their copies and found its help did not pay.
    unhelpful_until: AtomicU64,
    /// How long it stays away the next time it does not pay (doubling).
    unhelpful_for: AtomicU64,
    /// It sleeps until a poster wakes it.
    parked: AtomicBool,
    /// When a poster last found it parked (nanoseconds since [`epoch`]).
    found_parked: AtomicU64,
    cpus: usize,
    thread: OnceLock<Thread>,
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn helper() -> Option<&'static Helper> {
    static HELPER: OnceLock<Option<&'static Helper>> = OnceLock::new();
    *HELPER.get_or_init(|| {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        if std::env::var_os("SOFTRDMA_SHM_COPY_HELPER").is_some_and(|v| v == "0") || cpus < 2 {
            return None;
        }
        epoch();
        let h: &'static Helper = Box::leak(Box::new(Helper {
            board: CopyBoard::new(),
            ready: AtomicBool::new(false),
            missed: AtomicU64::new(0),
            unhelpful_until: AtomicU64::new(0),
            unhelpful_for: AtomicU64::new(UNHELPFUL_MIN.as_nanos() as u64),
            parked: AtomicBool::new(false),
            found_parked: AtomicU64::new(u64::MAX),
            cpus,
            thread: OnceLock::new(),
        }));
        let t = std::thread::Builder::new()
            .name("softrdma-copy".into())
            .spawn(move || h.run())
            .ok()?;
        let _ = h.thread.set(t.thread().clone());
        Some(h)
    })
}

/// Starts the helper (when a connection comes up: its first looks at the
/// CPUs then overlap the peers' setting up, not the first copies).
pub(super) fn start() {
    helper();
}

/// Whether this process has a helper (tests).
#[cfg(test)]
pub(super) fn on() -> bool {
    helper().is_some()
}

/// Copies `len` bytes from `src` at `src_at` into `dst` at `at`, sharing a
/// large copy with the helper (see the module).
///
/// # Panics
/// If either range reaches past its segment, as [`Segment::copy_from`].
pub(super) fn copy<D: Borrow<Region>, S: Borrow<Region>>(
    dst: &Segment<D>,
    at: usize,
    src: &Segment<S>,
    src_at: usize,
    len: usize,
) {
    if len >= SHARE_MIN
        && let Some(h) = helper()
    {
        if h.ready.load(Ordering::Relaxed) {
            let sample = PROBE.with(|p| p.borrow_mut().next());
            let start = (sample != Sample::No).then(Instant::now);
            if sample == Sample::Alone {
                dst.copy_from(at, src, src_at, len);
            } else if !h.board.copy(dst, at, src, src_at, len) {
                dst.copy_from(at, src, src_at, len);
                return;
            }
            if let Some(start) = start {
                let took = start.elapsed();
                let helps = PROBE.with(|p| p.borrow_mut().record(sample, took, len));
                match helps {
                    Some(false) => h.unhelpful(),
                    Some(true) => h.helpful(),
                    None => {}
                }
            }
            return;
        } else {
            // Tells a napping helper that copies are coming.
            h.missed.fetch_add(1, Ordering::SeqCst);
            h.wake_for(len);
        }
    }
    dst.copy_from(at, src, src_at, len);
}

impl Helper {
    /// Posters found copies with its help no faster than without: it stays
    /// away for a while, longer each time.
    fn unhelpful(&self) {
        let now = epoch().elapsed().as_nanos() as u64;
        let away = self.unhelpful_for.load(Ordering::Relaxed);
        self.unhelpful_until.store(now + away, Ordering::Relaxed);
        let next = (away * 2).min(UNHELPFUL_MAX.as_nanos() as u64);
        self.unhelpful_for.store(next, Ordering::Relaxed);
    }

    /// Posters found its help faster: the next stay away is short again.
    fn helpful(&self) {
        let min = UNHELPFUL_MIN.as_nanos() as u64;
        if self.unhelpful_for.load(Ordering::Relaxed) != min {
            self.unhelpful_for.store(min, Ordering::Relaxed);
        }
    }

    /// Wakes a parked helper for a copy of `len` bytes if that pays.
    fn wake_for(&self, len: usize) {
        if !self.parked.load(Ordering::SeqCst) {
            return;
        }
        let now = epoch().elapsed().as_nanos() as u64;
        let last = self.found_parked.swap(now, Ordering::Relaxed);
        let stream = now
            .checked_sub(last)
            .is_some_and(|gap| gap < spin_for(len).as_nanos() as u64);
        if (len >= WAKE_MIN || stream)
            && let Some(t) = self.thread.get()
        {
            t.unpark();
        }
    }

    fn run(&self) {
        let mut load = Load::open(self.cpus);
        let mut seen = self.board.generation();
        let mut ready = Ready::default();
        loop {
            seen = self.next_copy(seen, &mut load, &mut ready);
            let _chunks = self.board.help(seen);
            #[cfg(test)]
            CHUNKS_HELPED.fetch_add(_chunks as u64, Ordering::Relaxed);
        }
    }

    /// Waits for a copy newer than `seen` (see the module) and returns its
    /// generation: spins, naps, sleeps; backs off while the CPUs are busy.
    fn next_copy(&self, seen: u64, load: &mut Load, ready: &mut Ready) -> u64 {
        let mut idle_since = Instant::now();
        let mut nap = NAP_MIN;
        loop {
            let now = epoch().elapsed().as_nanos() as u64;
            let until = self.unhelpful_until.load(Ordering::Relaxed);
            if now < until {
                ready.set(self, false);
                std::thread::sleep(Duration::from_nanos(until - now));
                continue;
            }
            if load.crowded_now_and_then() {
                ready.set(self, false);
                load.back_off();
                continue;
            }
            ready.set(self, true);
            match self.spin_for_copy(seen) {
                Spun::Copy(g) => return g,
                Spun::Preempted => {
                    ready.set(self, false);
                    load.back_off();
                    continue;
                }
                Spun::Nothing => ready.set(self, false),
            }
            // Naps until a poster makes a large copy.
            let missed = self.missed.load(Ordering::Relaxed);
            loop {
                if idle_since.elapsed() < PARK_AFTER {
                    std::thread::sleep(nap);
                    nap = (nap * 2).min(NAP_MAX);
                } else {
                    self.parked.store(true, Ordering::SeqCst);
                    // A poster that copied before it could see `parked` did
                    // not wake this thread: look once more.
                    if self.missed.load(Ordering::SeqCst) == missed {
                        std::thread::park();
                    }
                    self.parked.store(false, Ordering::SeqCst);
                    idle_since = Instant::now();
                    nap = NAP_MIN;
                }
                if self.missed.load(Ordering::Relaxed) != missed {
                    break;
                }
            }
        }
    }

    /// Spins for a copy newer than `seen`, for as long as the last copy's
    /// size earns.
    fn spin_for_copy(&self, seen: u64) -> Spun {
        let spin = spin_for(self.board.last_len());
        let since = Instant::now();
        let mut looked = since;
        let mut spins = 0u32;
        loop {
            let g = self.board.generation();
            if g != seen {
                return Spun::Copy(g);
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                let now = Instant::now();
                if now - looked > PREEMPTED {
                    return Spun::Preempted;
                }
                if now - since > spin {
                    return Spun::Nothing;
                }
                looked = now;
            }
            std::hint::spin_loop();
        }
    }
}

thread_local! {
    /// This thread's timings of its copies (see [`Probe`]).
    static PROBE: std::cell::RefCell<Probe> = std::cell::RefCell::default();
}

/// Which copy a poster times.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Sample {
    No,
    /// Made alone, though the helper is ready.
    Alone,
    /// Made on the board.
    Shared,
}

/// A poster's timings: on some hosts the two CPUs pass cache lines so
/// slowly (the hypervisor placed them far apart) that copies shared with
/// the helper ran at 0.6 of one thread's; a poster that finds so tells the
/// helper to stay away.
#[derive(Default, Debug)]
struct Probe {
    copies: u32,
    /// Timed copies, nanoseconds per KiB.
    alone: Vec<f64>,
    shared: Vec<f64>,
}

impl Probe {
    fn next(&mut self) -> Sample {
        self.copies = self.copies.wrapping_add(1);
        if !self.copies.is_multiple_of(SAMPLE_EVERY) {
            Sample::No
        } else if (self.copies / SAMPLE_EVERY).is_multiple_of(2) {
            Sample::Alone
        } else {
            Sample::Shared
        }
    }

    /// Adds a timed copy; once there are enough of both kinds, whether the
    /// help pays (and starts over).
    fn record(&mut self, sample: Sample, took: Duration, len: usize) -> Option<bool> {
        let per_kib = took.as_nanos() as f64 * 1024.0 / len as f64;
        match sample {
            Sample::Alone => self.alone.push(per_kib),
            Sample::Shared => self.shared.push(per_kib),
            Sample::No => return None,
        }
        if self.alone.len() < SAMPLES || self.shared.len() < SAMPLES {
            return None;
        }
        let pays = typical(&self.shared) < typical(&self.alone) * WORTH;
        self.alone.clear();
        self.shared.clear();
        Some(pays)
    }
}

/// The mean of `times` but the slowest (an interrupt may have hit it).
fn typical(times: &[f64]) -> f64 {
    let slowest = times.iter().copied().fold(f64::MIN, f64::max);
    (times.iter().sum::<f64>() - slowest) / (times.len() - 1) as f64
}

/// Whether the helper told posters it is ready, kept here so that the
/// shared flag is written only when it changes (posters read it).
#[derive(Default)]
struct Ready(bool);

impl Ready {
    fn set(&mut self, helper: &Helper, on: bool) {
        if self.0 != on {
            self.0 = on;
            helper.ready.store(on, Ordering::Relaxed);
        }
    }
}

enum Spun {
    Copy(u64),
    Nothing,
    /// The thread lost its CPU while spinning.
    Preempted,
}

/// The running tasks the kernel counts (`/proc/loadavg`'s fourth field,
/// "running/all"), against the CPUs.
struct Load {
    loadavg: Option<File>,
    /// This thread's scheduler statistics (`/proc/thread-self/schedstat`).
    schedstat: Option<File>,
    cpus: usize,
    /// When it last looked, and how long it had waited for a CPU by then.
    checked: Option<(Instant, Duration)>,
    backoff: Duration,
    /// Back-offs in a row.
    backoffs: u32,
    /// The last look found the CPUs busy.
    was_busy: bool,
}

impl Load {
    /// For the calling thread.
    fn open(cpus: usize) -> Load {
        Load {
            loadavg: File::open("/proc/loadavg").ok(),
            schedstat: File::open("/proc/thread-self/schedstat").ok(),
            cpus,
            checked: None,
            backoff: BACKOFF_MIN,
            backoffs: 0,
            was_busy: false,
        }
    }

    /// Whether the CPUs are crowded: busy at this look and the last, where
    /// busy is more tasks running than there are CPUs (this thread among
    /// them), or this thread having spent more than [`WAITED_MAX`] of the
    /// time since it last looked waiting for a CPU (sharing one with its
    /// poster, which `/proc/loadavg` cannot show). Looked up at most every
    /// [`LOAD_EVERY`] (else `false`). A look that finds them not busy resets
    /// the back-off.
    fn crowded_now_and_then(&mut self) -> bool {
        let now = Instant::now();
        if self.checked.is_some_and(|(t, _)| now - t < LOAD_EVERY) {
            return false;
        }
        let waited = self.waited();
        let kept_waiting = match (self.checked, waited) {
            (Some((then, before)), Some(w)) => {
                w.saturating_sub(before).as_secs_f64() > (now - then).as_secs_f64() * WAITED_MAX
            }
            _ => false,
        };
        self.checked = waited.map(|w| (now, w));
        let busy = kept_waiting || self.running().is_some_and(|r| r > self.cpus);
        // One look in a hundred finds a task passing through (a kernel
        // worker, an interrupt's thread): busy twice in a row is crowded.
        let crowded = busy && self.was_busy;
        self.was_busy = busy;
        if !busy {
            self.backoff = BACKOFF_MIN;
            self.backoffs = 0;
        }
        crowded
    }

    fn running(&self) -> Option<usize> {
        let mut buf = [0u8; 128];
        let n = self.loadavg.as_ref()?.read_at(&mut buf, 0).ok()?;
        running_tasks(std::str::from_utf8(&buf[..n]).ok()?)
    }

    /// How long this thread has waited for a CPU in all.
    fn waited(&self) -> Option<Duration> {
        let mut buf = [0u8; 96];
        let n = self.schedstat.as_ref()?.read_at(&mut buf, 0).ok()?;
        waited_for_cpu(std::str::from_utf8(&buf[..n]).ok()?)
    }

    /// Sleeps out the back-off; every [`BACKOFFS_TO_DOUBLE`] in a row
    /// double it (a busy moment, such as a peer setting up, costs little
    /// help; busy CPUs, few looks).
    fn back_off(&mut self) {
        std::thread::sleep(self.backoff);
        self.backoffs += 1;
        if self.backoffs.is_multiple_of(BACKOFFS_TO_DOUBLE) {
            self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
        }
        self.checked = None;
    }
}

/// The time waited for a CPU in a `schedstat` line ("run_ns wait_ns
/// timeslices").
fn waited_for_cpu(schedstat: &str) -> Option<Duration> {
    let ns = schedstat.split_whitespace().nth(1)?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// The running tasks in a `/proc/loadavg` line: "0.30 0.30 0.14 1/83 2149".
fn running_tasks(loadavg: &str) -> Option<usize> {
    loadavg
        .split_whitespace()
        .nth(3)?
        .split('/')
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spins_are_bounded_and_grow_with_the_copy() {
        assert_eq!(spin_for(0), SPIN_MIN);
        assert_eq!(spin_for(usize::MAX), SPIN_MAX);
        assert!(spin_for(1 << 20) > spin_for(64 << 10));
    }

    #[test]
    fn posters_time_a_few_copies_and_judge_the_help() {
        let mut p = Probe::default();
        let kinds: Vec<Sample> = (0..4 * SAMPLE_EVERY).map(|_| p.next()).collect();
        let timed: Vec<Sample> = kinds.iter().copied().filter(|&k| k != Sample::No).collect();
        assert_eq!(
            timed,
            [Sample::Shared, Sample::Alone, Sample::Shared, Sample::Alone]
        );
        let kib = |ns: u64| (Duration::from_nanos(ns), 1024);
        // Help that halves the time pays, even with one copy hit by an
        // interrupt on each side; the verdict comes once both have enough.
        let mut verdict = None;
        for i in 0..SAMPLES {
            let slow = if i == 2 { 50 } else { 1 };
            let (t, len) = kib(10 * slow);
            assert_eq!(p.record(Sample::Alone, t, len), None);
            let (t, len) = kib(5 * slow);
            verdict = p.record(Sample::Shared, t, len);
        }
        assert_eq!(verdict, Some(true));
        // Help that saves 5 % does not; the sums started over.
        for _ in 0..SAMPLES {
            let (t, len) = kib(100);
            assert_eq!(p.record(Sample::Alone, t, len), None);
            let (t, len) = kib(95);
            verdict = p.record(Sample::Shared, t, len);
        }
        assert_eq!(verdict, Some(false));
        assert_eq!(p.record(Sample::No, Duration::ZERO, 1), None);
        assert_eq!(typical(&[1.0, 3.0, 100.0]), 2.0);
    }

    #[test]
    fn running_tasks_are_read_from_loadavg() {
        assert_eq!(running_tasks("0.30 0.30 0.14 1/83 2149\n"), Some(1));
        assert_eq!(running_tasks("2.00 1.00 0.50 17/400 9"), Some(17));
        assert_eq!(running_tasks("0.30 0.30"), None);
        assert_eq!(running_tasks("a b c x/83 1"), None);
        let here = std::fs::read_to_string("/proc/loadavg").unwrap();
        assert!(running_tasks(&here).is_some_and(|r| r >= 1), "{here}");
    }

    #[test]
    fn cpu_waits_are_read_from_schedstat() {
        assert_eq!(
            waited_for_cpu("1033501783 1417789 31\n"),
            Some(Duration::from_nanos(1_417_789))
        );
        assert_eq!(waited_for_cpu("12"), None);
        let load = Load::open(2);
        assert!(load.waited().is_some(), "this thread's schedstat");
    }
}
