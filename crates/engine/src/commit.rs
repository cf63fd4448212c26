//! A change's log record on its way to disk, and what follows its commit whether or not the
//! request that made it is still there.

use crate::engine::Engine;

/// A change's log record on its way to disk, awaited by the request that made the change.
/// What follows the commit (`then`: the view, the event, the loss notices, or taking back a
/// grant whose record failed) must not depend on whether that request is still there: cut
/// off by its deadline while the log commits, it hands the wait and `then` to a task of
/// their own. No hop on the common path.
pub(crate) struct Committing<'a, T: Send + 'static> {
    coord: &'a Engine,
    pending: Option<(automaton_backend::Commit, T)>,
    then: fn(&Engine, &T, &Result<(), String>),
}

impl<'a, T: Send + 'static> Committing<'a, T> {
    pub(crate) fn new(
        coord: &'a Engine,
        commit: automaton_backend::Commit,
        item: T,
        then: fn(&Engine, &T, &Result<(), String>),
    ) -> Self {
        Committing {
            coord,
            pending: Some((commit, item)),
            then,
        }
    }

    /// Waits for the commit, runs `then`, and gives `item` back with the outcome.
    pub(crate) async fn finish(mut self) -> (T, Result<(), String>) {
        let (commit, _) = self.pending.as_mut().expect("pending until finished");
        let logged = commit.await;
        let (_, item) = self.pending.take().expect("pending until finished");
        (self.then)(self.coord, &item, &logged);
        (item, logged)
    }
}

impl<T: Send + 'static> Drop for Committing<'_, T> {
    fn drop(&mut self) {
        let Some((commit, item)) = self.pending.take() else {
            return;
        };
        let then = self.then;
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                if let Some(coord) = self.coord.me.upgrade() {
                    runtime.spawn(async move {
                        let logged = commit.await;
                        then(&coord, &item, &logged);
                    });
                }
            }
            // Off any runtime, this thread may wait.
            Err(_) => then(self.coord, &item, &commit.wait_blocking()),
        }
    }
}
