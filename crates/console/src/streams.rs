//! Bounds on what a slow or greedy client can hold: the live streams one session (or, without
//! tokens, one client address) may keep open, and how long a write to a client may make no
//! progress before its connection is closed. An unread `/events` stream otherwise pins
//! megabytes of kernel send buffer for as long as the peer keeps it open.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// The default of [`StreamLimits::per_session`].
pub const DEFAULT_STREAMS_PER_SESSION: usize = 16;
/// The default of [`StreamLimits::stall_timeout`].
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(10);

/// How much of the console's live streams one client may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamLimits {
    /// Event and output streams one signed-in session may hold open at once (without
    /// tokens: one client address); one more is refused `429`.
    pub per_session: usize,
    /// A write to a client that makes no progress for this long closes its connection.
    pub stall_timeout: Duration,
}

impl Default for StreamLimits {
    fn default() -> Self {
        StreamLimits {
            per_session: DEFAULT_STREAMS_PER_SESSION,
            stall_timeout: DEFAULT_STALL_TIMEOUT,
        }
    }
}

/// Whose streams are counted together.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Holder {
    /// A signed-in session, by its cookie id.
    Session(String),
    /// Without tokens: a client address.
    Peer(IpAddr),
}

/// The open streams of every holder.
pub(crate) struct Slots {
    cap: usize,
    open: Arc<Mutex<HashMap<Holder, usize>>>,
}

/// One open stream, counted until it is dropped (when its response ends or its connection
/// closes).
pub(crate) struct Slot {
    holder: Holder,
    open: Arc<Mutex<HashMap<Holder, usize>>>,
}

impl Slots {
    pub fn new(cap: usize) -> Slots {
        Slots {
            cap: cap.max(1),
            open: Arc::default(),
        }
    }

    /// A slot for one more stream of `holder`, or the one-line reason there is none.
    pub fn take(&self, holder: Holder) -> Result<Slot, String> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let n = open.entry(holder.clone()).or_insert(0);
        if *n >= self.cap {
            let whose = match holder {
                Holder::Session(_) => "this session",
                Holder::Peer(_) => "your address",
            };
            return Err(format!(
                "too many live streams open for {whose} ({} at most, web_max_streams): close some console tabs, then reload",
                self.cap
            ));
        }
        *n += 1;
        Ok(Slot {
            holder,
            open: self.open.clone(),
        })
    }

    /// Streams `holder` holds open now.
    #[cfg(test)]
    fn held(&self, holder: &Holder) -> usize {
        let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.get(holder).copied().unwrap_or(0)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.get_mut(&self.holder) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.holder);
            }
        }
    }
}

/// A stream that holds its [`Slot`] for as long as it lives.
pub(crate) struct Held<S> {
    inner: S,
    _slot: Slot,
}

impl<S> Held<S> {
    pub fn new(inner: S, slot: Slot) -> Held<S> {
        Held { inner, _slot: slot }
    }
}

impl<S: Stream + Unpin> Stream for Held<S> {
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        Pin::new(&mut self.inner).poll_next(cx)
    }
}

/// A connection whose writes fail with `TimedOut` once one has made no progress for `bound`
/// (the client stopped reading and every buffer on the way is full): the connection ends and
/// whatever it streamed is dropped, instead of waiting on that client for ever.
pub(crate) struct WriteDeadline<I> {
    io: I,
    bound: Duration,
    peer: SocketAddr,
    /// Armed when a write first waits; disarmed by any progress.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<I> WriteDeadline<I> {
    pub fn new(io: I, bound: Duration, peer: SocketAddr) -> WriteDeadline<I> {
        WriteDeadline {
            io,
            bound,
            peer,
            stalled: None,
        }
    }

    /// `polled` was the inner write's answer: progress disarms the deadline, a wait arms it
    /// (once) and fails once it has passed.
    fn check<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let bound = self.bound;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(bound)));
        match timer.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => {
                tracing::info!(
                    peer = %self.peer,
                    stall_timeout = ?bound,
                    "console: a client read nothing for the stall timeout; its connection is closed"
                );
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no write progress for {bound:?}"),
                )))
            }
        }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for WriteDeadline<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.check(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.check(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.check(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_shutdown(cx);
        self.check(cx, polled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt as _;

    #[test]
    fn a_holder_gets_at_most_its_cap_and_a_dropped_stream_frees_its_slot() {
        let slots = Slots::new(2);
        let a = Holder::Session("a".into());
        let b = Holder::Peer([127, 0, 0, 1].into());
        let one = slots.take(a.clone()).expect("first");
        let two = slots.take(a.clone()).expect("second");
        let refused = slots.take(a.clone()).err().expect("third refused");
        assert!(refused.contains("this session (2 at most"), "{refused}");
        assert!(!refused.contains('\n'));
        // Another holder is counted apart.
        let other = slots.take(b.clone()).expect("another holder");
        assert_eq!(slots.held(&a), 2);
        drop(one);
        assert_eq!(slots.held(&a), 1);
        let _again = slots.take(a.clone()).expect("a freed slot is taken again");
        drop(two);
        drop(other);
        assert_eq!(slots.held(&b), 0);
        let refused = {
            let _x = slots.take(b.clone()).expect("b");
            let _y = slots.take(b.clone()).expect("b");
            slots.take(b.clone()).err().expect("b's third")
        };
        assert!(refused.contains("your address"), "{refused}");
    }

    /// A write that waits longer than the bound fails `TimedOut`; one that makes progress in
    /// time does not.
    #[tokio::test]
    async fn a_write_without_progress_fails_after_the_bound() {
        let peer: SocketAddr = "127.0.0.1:1".parse().expect("addr");
        // A pipe of 64 bytes that nobody reads.
        let (near, _far) = tokio::io::duplex(64);
        let mut w = WriteDeadline::new(near, Duration::from_millis(200), peer);
        let started = std::time::Instant::now();
        let e = w
            .write_all(&[0u8; 1024])
            .await
            .expect_err("the write stalls");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(200));
        assert!(started.elapsed() < Duration::from_secs(5));

        // A slow reader that keeps reading is never cut.
        let (near, mut far) = tokio::io::duplex(64);
        let mut w = WriteDeadline::new(near, Duration::from_millis(200), peer);
        let reader = tokio::spawn(async move {
            use tokio::io::AsyncReadExt as _;
            let mut buf = [0u8; 16];
            let mut total = 0;
            while total < 2048 {
                tokio::time::sleep(Duration::from_millis(5)).await;
                total += far.read(&mut buf).await.expect("read");
            }
        });
        w.write_all(&[0u8; 2048]).await.expect("progress in time");
        reader.await.expect("reader");
    }
}
