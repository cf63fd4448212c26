//! Fencing tokens: strictly increasing per project, also across restarts. They are handed out
//! from blocks reserved durably in `.automaton/fencing` (one durable write per block; a
//! restart starts after the reserved block). The next block is reserved on a background
//! thread while half of the current one is still left, so a claim waits for that write only
//! if the background one could not keep up — and never holds the lease table for it in the
//! common case.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use automaton_store::Project;

/// Tokens reserved at a time.
pub(crate) const TOKEN_BLOCK: u64 = 4096;

pub(crate) struct Fencing {
    project: Project,
    /// Every token up to this one is covered by the mark on disk.
    durable: AtomicU64,
    /// Serialises the writes of the mark, which therefore never goes down.
    write: Mutex<()>,
    /// A background reservation is under way.
    reserving: AtomicBool,
}

impl Fencing {
    /// `durable`: the mark already on disk.
    pub(crate) fn new(project: Project, durable: u64) -> Arc<Fencing> {
        Arc::new(Fencing {
            project,
            durable: AtomicU64::new(durable),
            write: Mutex::new(()),
            reserving: AtomicBool::new(false),
        })
    }

    /// Makes `token` safe to hand out: at once when the mark on disk covers it (starting the
    /// next block's reservation in the background when less than half a block is left),
    /// otherwise by reserving a block from it now.
    pub(crate) fn cover(self: &Arc<Self>, token: u64) -> Result<(), automaton_store::Error> {
        let durable = self.durable.load(Ordering::Acquire);
        if token > durable {
            return self.reserve(token.saturating_add(TOKEN_BLOCK - 1));
        }
        if durable - token < TOKEN_BLOCK / 2 && !self.reserving.swap(true, Ordering::AcqRel) {
            let me = self.clone();
            let target = durable.saturating_add(TOKEN_BLOCK);
            let spawned = std::thread::Builder::new()
                .name("fencing".into())
                .spawn(move || {
                    if let Err(e) = me.reserve(target) {
                        tracing::warn!(error = %e, "cannot reserve fencing tokens ahead");
                    }
                    me.reserving.store(false, Ordering::Release);
                });
            if spawned.is_err() {
                self.reserving.store(false, Ordering::Release);
            }
        }
        Ok(())
    }

    /// Writes `bound` as the mark, unless a higher one is already on disk.
    fn reserve(&self, bound: u64) -> Result<(), automaton_store::Error> {
        let _w = self.write.lock().unwrap_or_else(|p| p.into_inner());
        if bound <= self.durable.load(Ordering::Acquire) {
            return Ok(());
        }
        self.project.set_fencing_mark(bound)?;
        self.durable.store(bound, Ordering::Release);
        Ok(())
    }

    #[cfg(test)]
    fn durable(&self) -> u64 {
        self.durable.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait_for(f: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !f() {
            assert!(std::time::Instant::now() < deadline, "timed out");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    #[test]
    fn the_next_block_is_reserved_ahead_and_the_mark_never_goes_down() {
        let dir = tempfile::tempdir().expect("tempdir");
        let project = Project::open(dir.path(), None);
        project.set_fencing_mark(100).expect("mark");
        let f = Fencing::new(project.clone(), 100);
        // Plenty left: nothing written.
        f.cover(10).expect("covered");
        assert_eq!(f.durable(), 100);
        // Less than half a block left: the next block is reserved in the background.
        f.cover(99).expect("covered");
        wait_for(|| f.durable() == 100 + TOKEN_BLOCK);
        assert_eq!(project.fencing_mark().expect("mark"), 100 + TOKEN_BLOCK);
        // Beyond the mark: reserved now, before the token is handed out.
        let far = 10 * TOKEN_BLOCK;
        f.cover(far).expect("covered");
        assert_eq!(project.fencing_mark().expect("mark"), far + TOKEN_BLOCK - 1);
        // A lower reservation arriving late does not lower the mark.
        f.reserve(200).expect("no-op");
        assert_eq!(project.fencing_mark().expect("mark"), far + TOKEN_BLOCK - 1);
    }
}
