//! `automaton-bench echo-server --inline`: the echo server of `echo.rs` on the `h2` crate
//! directly, without tonic and hyper, with every `KeepAlive` stream of a connection answered
//! inside that connection's own task. hyper runs each HTTP/2 stream in a task of its own, so a
//! renewal there is read by the connection's task, answered by the stream's task and written
//! by the connection's task again; here one poll reads, answers and writes it. It measures
//! what renewals could reach on this machine without that hand-off.
//!
//! A measuring instrument, not a server to build on: no authentication, no limits beyond
//! h2's defaults and a cap on message size, answers made from the request alone. Unary calls
//! are answered as `echo.rs` answers them, each in a task of its own.

use std::future::poll_fn;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::task::{Context, Poll};

use anyhow::Result;
use automaton_proto::v1 as pb;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::Message;
use tokio::net::{TcpListener, TcpStream};

use crate::echo::{claimed, kept_alive, released, renewed};

/// Larger messages are refused; nothing the benchmark sends comes near it.
const MAX_MESSAGE: usize = 4 << 20;

const KEEP_ALIVE: &str = "/automaton.v1.Leases/KeepAlive";

/// gRPC status codes used here.
const OK: u16 = 0;
const INVALID_ARGUMENT: u16 = 3;
const RESOURCE_EXHAUSTED: u16 = 8;
const UNIMPLEMENTED: u16 = 12;

/// Serves on a bound listener until killed.
pub async fn serve_on(listener: TcpListener) -> Result<()> {
    let tokens = Arc::new(AtomicU64::new(0));
    loop {
        let sock = match listener.accept().await {
            Ok((sock, _)) => sock,
            Err(e) => {
                // Out of file descriptors, say: the connections already open go on.
                eprintln!("the inline echo server cannot accept a connection: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        // Small messages: Nagle plus delayed ACKs would add ~40 ms, as on the coordinator.
        if let Err(e) = sock.set_nodelay(true) {
            eprintln!("cannot set TCP_NODELAY on an accepted connection, closing it: {e}");
            continue;
        }
        tokio::spawn(connection(sock, tokens.clone()));
    }
}

/// One connection: its `KeepAlive` streams are polled here, in the connection's task.
async fn connection(sock: TcpStream, tokens: Arc<AtomicU64>) {
    let Ok(mut conn) = h2::server::handshake(sock).await else {
        return;
    };
    let mut streams: Vec<KeepAlive> = Vec::new();
    poll_fn(|cx| {
        loop {
            let mut progress = false;
            // Reads, and writes whatever the streams queued since the last poll.
            match conn.poll_accept(cx) {
                Poll::Ready(Some(Ok((req, respond)))) => {
                    progress = true;
                    if req.uri().path() == KEEP_ALIVE {
                        if let Some(s) = KeepAlive::open(req, respond) {
                            streams.push(s);
                        }
                    } else {
                        tokio::spawn(unary(req, respond, tokens.clone()));
                    }
                }
                Poll::Ready(Some(Err(_)) | None) => return Poll::Ready(()),
                Poll::Pending => {}
            }
            streams.retain_mut(|s| {
                let open = s.answer(cx).is_pending();
                progress |= std::mem::take(&mut s.answered);
                open
            });
            // Answers were queued: poll the connection again now, which writes them.
            if !progress {
                return Poll::Pending;
            }
        }
    })
    .await;
}

struct KeepAlive {
    recv: h2::RecvStream,
    send: h2::SendStream<Bytes>,
    /// Received bytes not yet a whole message.
    buf: BytesMut,
    /// Whether the last `answer` queued anything.
    answered: bool,
}

impl KeepAlive {
    fn open(
        req: http::Request<h2::RecvStream>,
        mut respond: h2::server::SendResponse<Bytes>,
    ) -> Option<KeepAlive> {
        let send = respond.send_response(headers(None), false).ok()?;
        Some(KeepAlive {
            recv: req.into_body(),
            send,
            buf: BytesMut::new(),
            answered: false,
        })
    }

    /// Answers every whole request received so far. Ready once the stream is over: ended by
    /// the client (answered with an OK status), refused, or broken.
    fn answer(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            match self.recv.poll_data(cx) {
                Poll::Ready(Some(Ok(chunk))) => {
                    let _ = self.recv.flow_control().release_capacity(chunk.len());
                    self.buf.extend_from_slice(&chunk);
                    loop {
                        match message(&mut self.buf) {
                            Ok(Some(m)) => {
                                let Ok(r) = pb::KeepAliveRequest::decode(m) else {
                                    return self.end(INVALID_ARGUMENT, "cannot decode the request");
                                };
                                let out = frame(&kept_alive(r));
                                if self.send.send_data(out, false).is_err() {
                                    return Poll::Ready(());
                                }
                                self.answered = true;
                            }
                            Ok(None) => break,
                            Err((code, why)) => return self.end(code, why),
                        }
                    }
                }
                Poll::Ready(Some(Err(_))) => return Poll::Ready(()),
                Poll::Ready(None) => return self.end(OK, ""),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn end(&mut self, code: u16, why: &str) -> Poll<()> {
        let _ = self.send.send_trailers(status(code, why));
        self.answered = true;
        Poll::Ready(())
    }
}

/// A unary call: the whole request, then the answer `echo.rs` gives.
async fn unary(
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    tokens: Arc<AtomicU64>,
) {
    let (parts, mut body) = req.into_parts();
    let mut buf = BytesMut::new();
    while let Some(chunk) = body.data().await {
        let Ok(chunk) = chunk else {
            return;
        };
        let _ = body.flow_control().release_capacity(chunk.len());
        if buf.len() + chunk.len() > MAX_MESSAGE + 5 {
            return trailers_only(respond, RESOURCE_EXHAUSTED, "message too large");
        }
        buf.extend_from_slice(&chunk);
    }
    let answer = match message(&mut buf) {
        Ok(Some(m)) => answer(parts.uri.path(), m, &tokens),
        Ok(None) => Err((INVALID_ARGUMENT, "the request holds no whole message")),
        Err(e) => Err(e),
    };
    match answer {
        Ok(out) => {
            let Ok(mut send) = respond.send_response(headers(None), false) else {
                return;
            };
            if send.send_data(out, false).is_ok() {
                let _ = send.send_trailers(status(OK, ""));
            }
        }
        Err((code, why)) => trailers_only(respond, code, why),
    }
}

type Refusal = (u16, &'static str);

fn answer(path: &str, m: Bytes, tokens: &AtomicU64) -> Result<Bytes, Refusal> {
    const BAD: Refusal = (INVALID_ARGUMENT, "cannot decode the request");
    Ok(match path {
        "/automaton.v1.Leases/Claim" => frame(&claimed(
            pb::ClaimRequest::decode(m).map_err(|_| BAD)?,
            tokens,
        )),
        "/automaton.v1.Leases/Renew" => {
            frame(&renewed(pb::RenewRequest::decode(m).map_err(|_| BAD)?))
        }
        "/automaton.v1.Leases/Release" => {
            frame(&released(pb::ReleaseRequest::decode(m).map_err(|_| BAD)?))
        }
        // What the benchmark's preparation calls; answered empty, as `echo.rs` does.
        "/automaton.v1.Tasks/CreateTask" => frame(&pb::TaskSummary::default()),
        "/automaton.v1.Tasks/GetTask" => frame(&pb::TaskDetail::default()),
        "/automaton.v1.Tasks/ListTasks" => frame(&pb::ListTasksResponse::default()),
        "/automaton.v1.Tasks/Transition" => frame(&pb::TransitionResponse::default()),
        _ => {
            return Err((
                UNIMPLEMENTED,
                "the inline echo server does not serve this method",
            ));
        }
    })
}

/// Takes the next whole gRPC message off `buf`, if one has arrived.
fn message(buf: &mut BytesMut) -> Result<Option<Bytes>, Refusal> {
    if buf.len() < 5 {
        return Ok(None);
    }
    if buf[0] != 0 {
        return Err((UNIMPLEMENTED, "compressed messages are not supported"));
    }
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if len > MAX_MESSAGE {
        return Err((RESOURCE_EXHAUSTED, "message too large"));
    }
    if buf.len() < 5 + len {
        return Ok(None);
    }
    buf.advance(5);
    Ok(Some(buf.split_to(len).freeze()))
}

/// `m` as one length-prefixed gRPC message.
fn frame<M: Message>(m: &M) -> Bytes {
    let len = m.encoded_len();
    let mut b = BytesMut::with_capacity(5 + len);
    b.put_u8(0);
    b.put_u32(len as u32);
    m.encode_raw(&mut b);
    b.freeze()
}

/// Response headers; with `status`, a trailers-only response.
fn headers(status: Option<(u16, &str)>) -> http::Response<()> {
    let mut r = http::Response::new(());
    let h = r.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    if let Some((code, why)) = status {
        h.extend(self::status(code, why));
    }
    r
}

fn status(code: u16, why: &str) -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    h.insert("grpc-status", http::HeaderValue::from(code));
    if !why.is_empty()
        && let Ok(why) = http::HeaderValue::from_str(why)
    {
        h.insert("grpc-message", why);
    }
    h
}

fn trailers_only(mut respond: h2::server::SendResponse<Bytes>, code: u16, why: &str) {
    let _ = respond.send_response(headers(Some((code, why))), true);
}
