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
//!   (`/proc/loadavg`, itself among them, against the host's CPUs online)
//!   and judges how long it waited for a CPU (its `schedstat`: sharing a
//!   CPU with its poster, it waits about half the time it runs or waits).
//!   More tasks than CPUs at two looks in a row, or too long a wait at two
//!   judgements in a row (one look in a hundred meets a passing kernel
//!   thread), or a spin that lost its CPU, and it helps no copy for a while
//!   ([`BACKOFF_MIN`], doubling every few in a row up to [`BACKOFF_MAX`]);
//!   a nap's wake-up then finds it an idle CPU if there is one. It must not
//!   take a CPU from the application's threads (a latency test's two
//!   pollers, say), and a poster waits for a chunk its helper holds.
//! - Posters time one copy in [`SAMPLE_EVERY`] of each size (powers of
//!   two), one in [`ALONE_EVERY`] of those made alone (after an untimed
//!   one alone, which takes back the lines the helper wrote), and make
//!   copies of that size alone for a while (from [`UNHELPFUL_MIN`],
//!   doubling while it goes on, up to [`UNHELPFUL_MAX`]) when shared ones
//!   do not save a tenth of the time: on some hosts the two CPUs pass
//!   cache lines so slowly that shared 64 KiB copies ran at 0.6 of one
//!   thread's. With no copies posted the helper naps and sleeps.
//! - A poster waiting for a chunk its helper holds spins for
//!   [`POSTER_SPIN`], then sleeps in [`POSTER_NAP`]s: the helper lost its
//!   CPU, perhaps to the poster.
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

/// A waiting helper's look at the CPUs judges its wait for one only over
/// this much time run or waited since the last judgement.
const WAIT_SPAN_MIN: Duration = Duration::from_millis(1);

/// A poster times one copy in [`SAMPLE_EVERY`] of a size, and judges the
/// help once it has [`SAMPLES`] of each kind (the newest).
const SAMPLE_EVERY: u32 = 32;
/// One timed copy in this many is made without the helper, after an
/// untimed one ([`Sample::Warm`]): two copies alone in every `SAMPLE_EVERY *
/// ALONE_EVERY`.
const ALONE_EVERY: u32 = 4;
const SAMPLES: usize = 6;
/// Sizes the poster judges apart: powers of two from [`SHARE_MIN`], the
/// last taking every larger copy.
const SIZE_CLASSES: usize = 8;
/// Help that does not save this share of a copy's time does not pay.
const WORTH: f64 = 0.9;
/// How long a poster whose copies of a size the help did not speed up makes
/// them alone: from [`UNHELPFUL_MIN`], doubling each time in a row, up to
/// [`UNHELPFUL_MAX`].
const UNHELPFUL_MIN: Duration = Duration::from_millis(50);
const UNHELPFUL_MAX: Duration = Duration::from_secs(2);

/// A poster waiting for the helper's chunk spins this long, then naps.
const POSTER_SPIN: Duration = Duration::from_micros(50);
const POSTER_NAP: Duration = Duration::from_micros(20);

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
    /// It sleeps until a poster wakes it.
    parked: AtomicBool,
    /// When a poster last found it parked (nanoseconds since [`epoch`]).
    found_parked: AtomicU64,
    thread: OnceLock<Thread>,
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn helper() -> Option<&'static Helper> {
    static HELPER: OnceLock<Option<&'static Helper>> = OnceLock::new();
    *HELPER.get_or_init(|| {
        // The CPUs this process may run on.
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        if std::env::var_os("SOFTRDMA_SHM_COPY_HELPER").is_some_and(|v| v == "0") || cpus < 2 {
            return None;
        }
        epoch();
        let h: &'static Helper = Box::leak(Box::new(Helper {
            board: CopyBoard::new(),
            ready: AtomicBool::new(false),
            missed: AtomicU64::new(0),
            parked: AtomicBool::new(false),
            found_parked: AtomicU64::new(u64::MAX),
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
        let sample = PROBE.with(|p| p.borrow_mut().next(len));
        if sample == Sample::Away {
            // Help did not pay for this size lately.
        } else if h.ready.load(Ordering::Relaxed) {
            let start = matches!(sample, Sample::Alone | Sample::Shared).then(Instant::now);
            if matches!(sample, Sample::Alone | Sample::Warm) {
                dst.copy_from(at, src, src_at, len);
            } else if !h.board.copy(dst, at, src, src_at, len, poster_wait()) {
                dst.copy_from(at, src, src_at, len);
                return;
            }
            if let Some(start) = start {
                let took = start.elapsed();
                PROBE.with(|p| p.borrow_mut().record(sample, took, len));
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

/// A poster's wait for a chunk its helper holds (see the module): called
/// every few hundred spins of a wait, with the count of calls in it.
fn poster_wait() -> impl FnMut(u32) {
    let mut since = None;
    move |calls| {
        let now = Instant::now();
        if calls <= 1 {
            since = Some(now);
        } else if since.is_some_and(|s| now - s > POSTER_SPIN) {
            std::thread::sleep(POSTER_NAP);
        }
    }
}

impl Helper {
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
        let mut load = Load::open(online_cpus());
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
        let mut missed_before = self.missed.load(Ordering::Relaxed);
        loop {
            let spun = if load.crowded_now_and_then() {
                None
            } else {
                ready.set(self, true);
                Some(self.spin_for_copy(seen))
            };
            match spun {
                Some(Spun::Copy(g)) => return g,
                Some(Spun::Nothing) => ready.set(self, false),
                None | Some(Spun::Preempted) => {
                    ready.set(self, false);
                    load.back_off();
                    // Copies made meanwhile keep it looking; without them
                    // for a while it sleeps (looking at the load adds to
                    // it).
                    let missed = self.missed.load(Ordering::Relaxed);
                    if missed != missed_before {
                        missed_before = missed;
                        idle_since = Instant::now();
                    }
                    if idle_since.elapsed() < PARK_AFTER {
                        continue;
                    }
                }
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
                        // What it judged before it slept is stale.
                        load.start_over();
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
    /// Made alone, untimed, just before an [`Alone`](Sample::Alone) one:
    /// right after shared copies into the same buffer (a stream into one
    /// region), a copy alone first takes back the lines the helper wrote
    /// from its CPU's cache, which later copies made alone do not pay (in
    /// some hours of this host, shared 64 KiB copies timed faster than such
    /// a copy and streamed slower than copies alone). Copies into other
    /// buffers each time find the lines wherever earlier copies left them,
    /// and this one changes little there.
    Warm,
    /// Made alone, though the helper is ready.
    Alone,
    /// Made on the board.
    Shared,
    /// Made alone: help did not pay for copies of this size lately.
    Away,
}

/// A poster's timings: on some hosts the two CPUs pass cache lines so
/// slowly (the hypervisor placed them far apart) that copies shared with
/// the helper ran at 0.6 of one thread's; a poster that finds so makes
/// copies of that size alone for a while.
#[derive(Default, Debug)]
struct Probe {
    classes: [SizeProbe; SIZE_CLASSES],
}

/// A poster's timings of copies of one size class.
#[derive(Debug)]
struct SizeProbe {
    copies: u32,
    /// Timed copies, nanoseconds per KiB.
    alone: Vec<f64>,
    shared: Vec<f64>,
    /// Copies are made alone until then.
    away_until: Option<Instant>,
    /// How long the next stay away lasts.
    away_for: Duration,
}

impl Default for SizeProbe {
    fn default() -> SizeProbe {
        SizeProbe {
            copies: 0,
            alone: Vec::new(),
            shared: Vec::new(),
            away_until: None,
            away_for: UNHELPFUL_MIN,
        }
    }
}

/// The size class of a copy of `len` (at least [`SHARE_MIN`]) bytes.
fn size_class(len: usize) -> usize {
    let class = len.ilog2().saturating_sub(SHARE_MIN.ilog2()) as usize;
    class.min(SIZE_CLASSES - 1)
}

impl Probe {
    fn next(&mut self, len: usize) -> Sample {
        let p = &mut self.classes[size_class(len)];
        if let Some(until) = p.away_until {
            if Instant::now() < until {
                return Sample::Away;
            }
            p.away_until = None;
        }
        p.copies = p.copies.wrapping_add(1);
        // The copy after a warm one is the timed one alone. The count's
        // first copy follows none, so it is not timed (nor, once in 2^32
        // copies, the one after the count wraps).
        match p.copies % (SAMPLE_EVERY * ALONE_EVERY) {
            0 => Sample::Warm,
            1 if p.copies > 1 => Sample::Alone,
            k if k.is_multiple_of(SAMPLE_EVERY) => Sample::Shared,
            _ => Sample::No,
        }
    }

    /// Adds a timed copy; once there are enough of both kinds for its
    /// size, whether the help pays (and starts over). Help that does not
    /// sends copies of that size alone for a while.
    fn record(&mut self, sample: Sample, took: Duration, len: usize) -> Option<bool> {
        let p = &mut self.classes[size_class(len)];
        let per_kib = took.as_nanos() as f64 * 1024.0 / len as f64;
        let times = match sample {
            Sample::Alone => &mut p.alone,
            Sample::Shared => &mut p.shared,
            Sample::No | Sample::Warm | Sample::Away => return None,
        };
        // The newest only: shared copies are timed three times as often,
        // and older timings may date from before a slow spell began.
        if times.len() == SAMPLES {
            times.remove(0);
        }
        times.push(per_kib);
        if p.alone.len() < SAMPLES || p.shared.len() < SAMPLES {
            return None;
        }
        let pays = typical(&p.shared) < typical(&p.alone) * WORTH;
        p.alone.clear();
        p.shared.clear();
        if pays {
            p.away_for = UNHELPFUL_MIN;
        } else {
            p.away_until = Some(Instant::now() + p.away_for);
            p.away_for = (p.away_for * 2).min(UNHELPFUL_MAX);
        }
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
/// "running/all"), against the CPUs; and the helper's own waits for a CPU.
struct Load {
    loadavg: Option<File>,
    /// This thread's scheduler statistics (`/proc/thread-self/schedstat`).
    schedstat: Option<File>,
    /// The host's CPUs online: `/proc/loadavg` counts the host's tasks.
    cpus: usize,
    /// When it last looked.
    looked: Option<Instant>,
    verdicts: Verdicts,
}

/// What the helper's looks at the CPUs found so far.
#[derive(Debug)]
struct Verdicts {
    /// Its time run and waited for a CPU when it last judged its waits.
    judged: Option<CpuTimes>,
    backoff: Duration,
    /// Back-offs in a row.
    backoffs: u32,
    /// The last look found more tasks running than CPUs.
    was_running_over: bool,
    /// The last judgement of its waits found it waited too long.
    had_waited: bool,
}

impl Default for Verdicts {
    fn default() -> Verdicts {
        Verdicts {
            judged: None,
            backoff: BACKOFF_MIN,
            backoffs: 0,
            was_running_over: false,
            had_waited: false,
        }
    }
}

/// A thread's time on a CPU and waiting for one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CpuTimes {
    ran: Duration,
    waited: Duration,
}

impl Load {
    /// For the calling thread.
    fn open(cpus: usize) -> Load {
        Load {
            loadavg: File::open("/proc/loadavg").ok(),
            schedstat: File::open("/proc/thread-self/schedstat").ok(),
            cpus,
            looked: None,
            verdicts: Verdicts::default(),
        }
    }

    /// Whether the CPUs are crowded: more tasks running than there are
    /// CPUs (this thread among them) at this look and the last, or this
    /// thread having spent more than [`WAITED_MAX`] of its time waiting for
    /// a CPU at this judgement of its waits and the last (sharing one with
    /// its poster, which `/proc/loadavg` cannot show; a judgement takes
    /// [`WAIT_SPAN_MIN`] run or waited, so a back-off's sleep does not
    /// dilute it). One look in a hundred finds a task passing through (a
    /// kernel worker, an interrupt's thread): hence twice in a row. Looked
    /// up at most every [`LOAD_EVERY`] (else `false`). The back-off resets
    /// once neither signal is busy.
    fn crowded_now_and_then(&mut self) -> bool {
        let now = Instant::now();
        if self.looked.is_some_and(|t| now - t < LOAD_EVERY) {
            return false;
        }
        self.looked = Some(now);
        let waited = match self.cpu_times() {
            None => Some(false),
            Some(times) => match self.verdicts.judged {
                None => {
                    self.verdicts.judged = Some(times);
                    None
                }
                Some(before) => {
                    let verdict = waited_too_long(before, times);
                    if verdict.is_some() {
                        self.verdicts.judged = Some(times);
                    }
                    verdict
                }
            },
        };
        let running_over = self.running().is_some_and(|r| r > self.cpus);
        self.judge(running_over, waited)
    }

    /// The verdict of a look that found `running_over` and, if it could
    /// judge them, its waits too long or not.
    fn judge(&mut self, running_over: bool, waited: Option<bool>) -> bool {
        let crowded = (running_over && self.verdicts.was_running_over)
            || (waited == Some(true) && self.verdicts.had_waited);
        self.verdicts.was_running_over = running_over;
        if let Some(w) = waited {
            self.verdicts.had_waited = w;
        }
        if !running_over && !self.verdicts.had_waited {
            self.verdicts.backoff = BACKOFF_MIN;
            self.verdicts.backoffs = 0;
        }
        crowded
    }

    fn running(&self) -> Option<usize> {
        let mut buf = [0u8; 128];
        let n = self.loadavg.as_ref()?.read_at(&mut buf, 0).ok()?;
        running_tasks(std::str::from_utf8(&buf[..n]).ok()?)
    }

    /// This thread's time run and waited for a CPU, in all.
    fn cpu_times(&self) -> Option<CpuTimes> {
        let mut buf = [0u8; 96];
        let n = self.schedstat.as_ref()?.read_at(&mut buf, 0).ok()?;
        cpu_times(std::str::from_utf8(&buf[..n]).ok()?)
    }

    /// Sleeps out the back-off; every [`BACKOFFS_TO_DOUBLE`] in a row
    /// double it (a busy moment, such as a peer setting up, costs little
    /// help; busy CPUs, few looks).
    fn back_off(&mut self) {
        std::thread::sleep(self.verdicts.backoff);
        self.backed_off();
    }

    /// Forgets earlier looks and back-offs.
    fn start_over(&mut self) {
        self.verdicts = Verdicts::default();
    }

    fn backed_off(&mut self) {
        self.verdicts.backoffs += 1;
        if self.verdicts.backoffs.is_multiple_of(BACKOFFS_TO_DOUBLE) {
            self.verdicts.backoff = (self.verdicts.backoff * 2).min(BACKOFF_MAX);
        }
    }
}

/// Whether a thread waited for a CPU more than [`WAITED_MAX`] of its time
/// between two readings of its [`CpuTimes`]; `None` if it ran and waited
/// too little in between to tell (it slept).
fn waited_too_long(before: CpuTimes, now: CpuTimes) -> Option<bool> {
    let ran = now.ran.saturating_sub(before.ran);
    let waited = now.waited.saturating_sub(before.waited);
    let span = ran + waited;
    (span >= WAIT_SPAN_MIN).then_some(waited.as_secs_f64() > span.as_secs_f64() * WAITED_MAX)
}

/// The times in a `schedstat` line ("run_ns wait_ns timeslices").
fn cpu_times(schedstat: &str) -> Option<CpuTimes> {
    let mut fields = schedstat.split_whitespace();
    let ran = fields.next()?.parse().ok()?;
    let waited = fields.next()?.parse().ok()?;
    Some(CpuTimes {
        ran: Duration::from_nanos(ran),
        waited: Duration::from_nanos(waited),
    })
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

/// The host's CPUs online (`/proc/loadavg` counts the host's tasks, where a
/// container's process may run on fewer CPUs); the process's own if the
/// host's list cannot be read.
fn online_cpus() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|list| cpus_in_list(&list))
        .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
        .unwrap_or(1)
}

/// The CPUs in a kernel CPU list: "0-3,6,8-9".
fn cpus_in_list(list: &str) -> Option<usize> {
    let mut count = 0;
    for part in list.trim().split(',') {
        count += match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                b.checked_sub(a)? + 1
            }
            None => {
                part.parse::<usize>().ok()?;
                1
            }
        };
    }
    (count > 0).then_some(count)
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
        let len = 64 << 10;
        let kinds: Vec<Sample> = (0..2 * ALONE_EVERY * SAMPLE_EVERY + 1)
            .map(|_| p.next(len))
            .collect();
        let (s, a) = (Sample::Shared, Sample::Alone);
        let timed: Vec<Sample> = kinds
            .iter()
            .copied()
            .filter(|&k| k == a || k == s)
            .collect();
        assert_eq!(timed, [s, s, s, a, s, s, s, a]);
        // Every timed copy alone comes right after an untimed one alone.
        for (i, &k) in kinds.iter().enumerate() {
            assert_eq!(k == a, i > 0 && kinds[i - 1] == Sample::Warm, "copy {i}");
            assert_eq!(k == Sample::Warm, kinds.get(i + 1) == Some(&a), "copy {i}");
        }
        let ns = Duration::from_nanos;
        // Help that halves the time pays, even with an interrupt in one
        // timing of each kind; the verdict comes once both kinds have
        // enough, and only the newest shared ones count (they come three to
        // one), not the slow ones from before.
        for _ in 0..SAMPLES {
            assert_eq!(p.record(Sample::Shared, ns(6400), len), None);
        }
        let mut verdict = None;
        for i in 0..SAMPLES {
            let slow = if i == 2 { 50 } else { 1 };
            for k in 1..ALONE_EVERY {
                // One of the shared timings that count is slow too.
                let slow = if i == SAMPLES - 1 && k == 1 { 50 } else { slow };
                assert_eq!(p.record(Sample::Shared, ns(320 * slow), len), None);
            }
            assert_eq!(p.record(Sample::Warm, ns(1), len), None, "untimed");
            verdict = p.record(Sample::Alone, ns(640 * slow), len);
        }
        assert_eq!(verdict, Some(true));
        assert_ne!(p.next(len), Sample::Away);
        // Help that saves 5 % does not; the timings started over. Copies of
        // that size are then made alone; other sizes go on as before.
        for _ in 0..SAMPLES {
            for _ in 1..ALONE_EVERY {
                assert_eq!(p.record(Sample::Shared, ns(6080), len), None);
            }
            verdict = p.record(Sample::Alone, ns(6400), len);
        }
        assert_eq!(verdict, Some(false));
        assert_eq!(p.next(len), Sample::Away);
        assert_eq!(p.next(len + 1000), Sample::Away, "the same size class");
        assert_ne!(p.next(1 << 20), Sample::Away);
        assert_eq!(p.classes[size_class(len)].away_for, UNHELPFUL_MIN * 2);
        assert_eq!(p.record(Sample::No, Duration::ZERO, len), None);
        assert_eq!(typical(&[1.0, 3.0, 100.0]), 2.0);
    }

    #[test]
    fn size_classes_are_powers_of_two() {
        assert_eq!(size_class(SHARE_MIN), 0);
        assert_eq!(size_class(2 * SHARE_MIN - 1), 0);
        assert_eq!(size_class(64 << 10), 1);
        assert_eq!(size_class(1 << 20), 5);
        assert_eq!(size_class(usize::MAX), SIZE_CLASSES - 1);
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
    fn cpu_times_are_read_from_schedstat() {
        assert_eq!(
            cpu_times("1033501783 1417789 31\n"),
            Some(CpuTimes {
                ran: Duration::from_nanos(1_033_501_783),
                waited: Duration::from_nanos(1_417_789)
            })
        );
        assert_eq!(cpu_times("12"), None);
        let load = Load::open(2);
        assert!(load.cpu_times().is_some(), "this thread's schedstat");
    }

    /// The share of its time a thread waited counts the time it ran or
    /// waited, not time asleep; too little of either tells nothing.
    #[test]
    fn cpu_waits_are_judged_against_time_run_or_waited() {
        let at = |ran_us: u64, waited_us: u64| CpuTimes {
            ran: Duration::from_micros(ran_us),
            waited: Duration::from_micros(waited_us),
        };
        assert_eq!(WAIT_SPAN_MIN, Duration::from_millis(1));
        let before = at(10_000, 1_000);
        // Shared a CPU with its poster: half its time waiting.
        assert_eq!(waited_too_long(before, at(11_000, 2_000)), Some(true));
        // Ran alone, a short wait for a timer's wake-up.
        assert_eq!(waited_too_long(before, at(12_000, 1_100)), Some(false));
        // Slept (a back-off): nothing to judge.
        assert_eq!(waited_too_long(before, at(10_100, 1_050)), None);
        assert_eq!(waited_too_long(before, before), None);
    }

    /// Busy twice in a row by either signal is crowded; looks that cannot
    /// judge the waits (after a back-off's sleep) neither break a run of
    /// waits nor reset the back-off, which doubles while it goes on.
    #[test]
    fn crowding_takes_two_busy_looks_and_backs_off_longer_while_it_lasts() {
        let mut load = Load::open(2);
        assert!(!load.judge(true, Some(false)));
        assert!(load.judge(true, None), "tasks over the CPUs twice");
        assert!(!load.judge(false, Some(false)));
        assert!(!load.judge(true, Some(false)), "once is a passing task");
        assert!(!load.judge(false, Some(false)));
        assert_eq!(load.verdicts.backoff, BACKOFF_MIN);
        // Sharing a CPU with its poster: each judgement of the waits finds
        // them too long, with looks that cannot judge in between.
        assert!(!load.judge(false, Some(true)));
        let mut crowded = 0;
        for _ in 0..4 * BACKOFFS_TO_DOUBLE {
            assert!(!load.judge(false, None));
            if load.judge(false, Some(true)) {
                crowded += 1;
                load.backed_off();
            }
        }
        assert_eq!(crowded, 4 * BACKOFFS_TO_DOUBLE);
        assert_eq!(load.verdicts.backoff, BACKOFF_MIN * 16);
        // A judgement that finds the waits short ends it.
        assert!(!load.judge(false, Some(false)));
        assert_eq!(load.verdicts.backoff, BACKOFF_MIN);
    }

    #[test]
    fn online_cpus_are_counted_from_the_kernels_list() {
        assert_eq!(cpus_in_list("0-1\n"), Some(2));
        assert_eq!(cpus_in_list("0-3,6,8-9"), Some(7));
        assert_eq!(cpus_in_list("5"), Some(1));
        assert_eq!(cpus_in_list(""), None);
        assert_eq!(cpus_in_list("3-1"), None);
        assert_eq!(cpus_in_list("x"), None);
        assert!(online_cpus() >= 1);
    }
}
