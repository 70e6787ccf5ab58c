//! Tests: a thread that watches a range's last byte while copies of one
//! rising value each (1, 2, ...) land in it, and checks that whenever the
//! last byte changes no byte of the range is older. x86 keeps stores in
//! order for every observer; the watcher's plain reads rely on that.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

/// See the module.
pub(super) struct LastByteWatch {
    watching: Arc<AtomicBool>,
    thread: JoinHandle<u32>,
}

impl LastByteWatch {
    /// Watches `len` bytes that `read(offset, out)` reads; returns once the
    /// thread is watching.
    pub(super) fn start(
        len: usize,
        mut read: impl FnMut(usize, &mut [u8]) + Send + 'static,
    ) -> LastByteWatch {
        let (watching, started) = (
            Arc::new(AtomicBool::new(true)),
            Arc::new(AtomicBool::new(false)),
        );
        let thread = {
            let (watching, started) = (Arc::clone(&watching), Arc::clone(&started));
            std::thread::spawn(move || {
                let (mut last, mut seen, mut out) = (0u8, 0u32, vec![0u8; len]);
                started.store(true, Ordering::Release);
                // Looks once more after the copies end.
                let mut more = true;
                while std::mem::replace(&mut more, watching.load(Ordering::Relaxed)) {
                    let mut b = [0u8];
                    read(len - 1, &mut b);
                    if b[0] != last {
                        last = b[0];
                        read(0, &mut out);
                        // Later copies may have begun: newer bytes are
                        // fine, older ones are not.
                        let older = out.iter().position(|&x| x < last);
                        assert_eq!(older, None, "{len} bytes, copy {last}: an older byte");
                        seen += 1;
                    }
                }
                seen
            })
        };
        while !started.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
        LastByteWatch { watching, thread }
    }

    /// Stops watching (after one more look); how many copies it saw land.
    pub(super) fn stop(self) -> u32 {
        self.watching.store(false, Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}
