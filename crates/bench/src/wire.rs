//! A minimal HTTP/2 gRPC client for the load generator (`--client raw`): one connection, one
//! call at a time, frames written and read straight on the socket by the task that makes the
//! call.
//!
//! Why it exists: client and server share this machine's two cores, so whatever the load
//! generator spends is taken from the system it measures. A tonic unary call hops between
//! three tasks (the caller, the channel's buffer worker, the connection task) and cost the
//! client about 40 µs of CPU here; through this client, one `write` and usually one `read`
//! per call, about 13 µs. Both systems are measured through the same client, and
//! `--client tonic` keeps the stock client for a cross-check.
//!
//! What it does not do, on purpose: no HPACK decoding (response headers and trailers are
//! skipped, so a call counts as failed exactly when no message came back: servers answer a
//! gRPC error with a trailers-only response), no compression, no TLS, no concurrent streams.
//! It does keep HTTP/2's rules: flow control both ways, SETTINGS and PING acknowledged,
//! padding stripped, GOAWAY and RST_STREAM reported.

use anyhow::{Context, Result, anyhow, bail};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;

const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;

const SETTINGS_ENABLE_PUSH: u16 = 0x2;
const SETTINGS_INITIAL_WINDOW_SIZE: u16 = 0x4;
const SETTINGS_MAX_FRAME_SIZE: u16 = 0x5;

/// HTTP/2's initial window, before any SETTINGS or WINDOW_UPDATE.
const DEFAULT_WINDOW: i64 = 65_535;
/// The largest frame a peer must accept before its SETTINGS say otherwise.
const DEFAULT_MAX_FRAME: usize = 16_384;
/// What this client lets the server send ahead, per stream and per connection; topped up
/// whenever half of it is used.
const RECV_WINDOW: u32 = 1 << 30;
/// The error code of an RST_STREAM that abandons a stream.
const CANCEL: u32 = 0x8;

/// One HTTP/2 connection to a gRPC server.
pub struct Conn {
    io: TcpStream,
    authority: String,
    /// Bytes read and not yet parsed: `rbuf[rpos..]`.
    rbuf: Vec<u8>,
    rpos: usize,
    /// Frames waiting to be written.
    wbuf: Vec<u8>,
    next_id: u32,
    /// The stream in use; 0 before the first call.
    stream: u32,
    /// The server ended the stream in use (END_STREAM seen).
    ended: bool,
    /// DATA received on the stream in use and not yet taken as messages.
    body: Vec<u8>,
    /// How much this client may still send on the connection and on the stream in use.
    send_conn: i64,
    send_stream: i64,
    /// The server's SETTINGS_INITIAL_WINDOW_SIZE and SETTINGS_MAX_FRAME_SIZE.
    peer_initial: i64,
    max_frame: usize,
    /// Received DATA not yet returned to the server's windows.
    recv_conn_used: u32,
    recv_stream_used: u32,
    /// The server said GOAWAY: no new streams.
    going_away: bool,
    /// This client's receive window (RECV_WINDOW but in tests).
    recv_window: u32,
}

impl Conn {
    /// Connects to `addr` (`host:port`) and sends the connection preface and this client's
    /// SETTINGS; the server's are taken as they come.
    pub async fn connect(addr: &str) -> Result<Conn> {
        Conn::connect_with_window(addr, RECV_WINDOW).await
    }

    async fn connect_with_window(addr: &str, recv_window: u32) -> Result<Conn> {
        let io = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connect to {addr}"))?;
        io.set_nodelay(true)?;
        let mut c = Conn {
            io,
            authority: addr.to_string(),
            rbuf: Vec::with_capacity(64 << 10),
            rpos: 0,
            wbuf: Vec::with_capacity(4 << 10),
            next_id: 1,
            stream: 0,
            ended: true,
            body: Vec::with_capacity(1 << 10),
            send_conn: DEFAULT_WINDOW,
            send_stream: 0,
            peer_initial: DEFAULT_WINDOW,
            max_frame: DEFAULT_MAX_FRAME,
            recv_conn_used: 0,
            recv_stream_used: 0,
            going_away: false,
            recv_window,
        };
        c.wbuf.extend_from_slice(PREFACE);
        let mut settings = Vec::with_capacity(12);
        for (id, value) in [
            (SETTINGS_ENABLE_PUSH, 0),
            (SETTINGS_INITIAL_WINDOW_SIZE, recv_window),
        ] {
            settings.extend_from_slice(&id.to_be_bytes());
            settings.extend_from_slice(&value.to_be_bytes());
        }
        c.frame(SETTINGS, 0, 0, &settings);
        if let Some(more) = recv_window
            .checked_sub(DEFAULT_WINDOW as u32)
            .filter(|&m| m > 0)
        {
            c.window_update(0, more);
        }
        c.flush().await?;
        Ok(c)
    }

    /// One unary call: request out, exactly one response message back, stream ended.
    pub async fn unary<Q: Message, R: Message + Default>(
        &mut self,
        path: &str,
        request: &Q,
    ) -> Result<R> {
        self.open(path)?;
        self.send_message(request, true).await?;
        let response = self.receive::<R>().await?.ok_or_else(|| refused(path))?;
        while !self.ended {
            self.read_frame().await?;
        }
        if !self.body.is_empty() {
            bail!("{path}: more than one response message to a unary call");
        }
        Ok(response)
    }

    /// Opens a stream for `path` (abandoning the previous one if it is still open) and queues
    /// its HEADERS; they go out with the first message.
    pub fn open(&mut self, path: &str) -> Result<()> {
        if self.going_away {
            bail!("the server is closing the connection (GOAWAY): no new calls on it");
        }
        if !self.ended {
            self.frame(RST_STREAM, 0, self.stream, &CANCEL.to_be_bytes());
        }
        if self.next_id > (1 << 31) - 2 {
            bail!("this connection has used all its stream ids");
        }
        self.stream = self.next_id;
        self.next_id += 2;
        self.ended = false;
        self.body.clear();
        self.send_stream = self.peer_initial;
        self.recv_stream_used = 0;
        let block = header_block(path, &self.authority);
        self.frame(HEADERS, END_HEADERS, self.stream, &block);
        Ok(())
    }

    /// Sends one message on the stream in use, with END_STREAM if `last`: in frames no
    /// larger than the server allows, each when flow control gives credit for it.
    pub async fn send_message<Q: Message>(&mut self, message: &Q, last: bool) -> Result<()> {
        let len = message.encoded_len();
        let total = 5 + len;
        let flags = if last { END_STREAM } else { 0 };
        if (total as i64) <= self.send_conn.min(self.send_stream) && total <= self.max_frame {
            // The usual case: one frame, encoded in place.
            self.take_credit(total);
            self.frame_header(total, DATA, flags, self.stream);
            self.wbuf.push(0);
            self.wbuf.extend_from_slice(&(len as u32).to_be_bytes());
            message.encode(&mut self.wbuf)?;
            return Ok(());
        }
        let mut out = Vec::with_capacity(total);
        out.push(0);
        out.extend_from_slice(&(len as u32).to_be_bytes());
        message.encode(&mut out)?;
        let mut sent = 0;
        while sent < total {
            let credit = self.send_conn.min(self.send_stream).max(0) as usize;
            if credit == 0 {
                if self.ended {
                    bail!("the server ended the call before it took the request");
                }
                self.flush().await?;
                self.read_frame().await?;
                continue;
            }
            let n = credit.min(self.max_frame).min(total - sent);
            self.take_credit(n);
            let end = if sent + n == total { flags } else { 0 };
            self.frame_header(n, DATA, end, self.stream);
            self.wbuf.extend_from_slice(&out[sent..sent + n]);
            sent += n;
        }
        Ok(())
    }

    fn take_credit(&mut self, n: usize) {
        self.send_conn -= n as i64;
        self.send_stream -= n as i64;
    }

    /// The next response message on the stream in use, or `None` once the server ended it.
    /// Writes whatever is queued first.
    pub async fn receive<R: Message + Default>(&mut self) -> Result<Option<R>> {
        self.flush().await?;
        loop {
            if self.body.len() >= 5 {
                if self.body[0] != 0 {
                    bail!("the server sent a compressed message; this client asks for none");
                }
                let len =
                    u32::from_be_bytes([self.body[1], self.body[2], self.body[3], self.body[4]])
                        as usize;
                if self.body.len() >= 5 + len {
                    let message = R::decode(&self.body[5..5 + len])
                        .context("the server's message does not decode")?;
                    self.body.drain(..5 + len);
                    return Ok(Some(message));
                }
            }
            if self.ended {
                if !self.body.is_empty() {
                    bail!("the server ended the call in the middle of a message");
                }
                return Ok(None);
            }
            self.read_frame().await?;
            if !self.wbuf.is_empty() {
                // Acknowledgements and window updates the frame called for.
                self.flush().await?;
            }
        }
    }

    async fn flush(&mut self) -> Result<()> {
        if !self.wbuf.is_empty() {
            self.io
                .write_all(&self.wbuf)
                .await
                .context("write to the server")?;
            self.wbuf.clear();
        }
        Ok(())
    }

    /// Reads and handles one frame.
    async fn read_frame(&mut self) -> Result<()> {
        self.fill(9).await?;
        let h = &self.rbuf[self.rpos..self.rpos + 9];
        let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
        let (ty, flags) = (h[3], h[4]);
        let sid = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        self.fill(9 + len).await?;
        let start = self.rpos + 9;
        self.rpos = start + len;
        // Copy-free view of the payload: the buffer is not touched again until the next fill.
        let payload = start..start + len;
        match ty {
            DATA => {
                self.recv_conn_used += len as u32;
                if sid == self.stream && !self.ended {
                    let body = unpad(&self.rbuf[payload], flags)?;
                    self.body.extend_from_slice(body);
                    self.recv_stream_used += len as u32;
                    if flags & END_STREAM != 0 {
                        self.ended = true;
                    } else if self.recv_stream_used >= self.recv_window / 2 {
                        let used = std::mem::take(&mut self.recv_stream_used);
                        self.window_update(self.stream, used);
                    }
                }
                if self.recv_conn_used >= self.recv_window / 2 {
                    let used = std::mem::take(&mut self.recv_conn_used);
                    self.window_update(0, used);
                }
            }
            // Headers and trailers are not decoded (see the module comment); only whether
            // they end the stream matters.
            HEADERS if sid == self.stream && flags & END_STREAM != 0 => self.ended = true,
            RST_STREAM if sid == self.stream && !self.ended => {
                let code = be32(&self.rbuf[payload])?;
                bail!("the server reset the call (HTTP/2 error code {code:#x})");
            }
            SETTINGS if flags & ACK == 0 => {
                let p = &self.rbuf[payload];
                if !p.len().is_multiple_of(6) {
                    bail!("malformed SETTINGS frame from the server");
                }
                let mut new_initial = None;
                for s in p.chunks_exact(6) {
                    let value = be32(&s[2..])?;
                    match u16::from_be_bytes([s[0], s[1]]) {
                        SETTINGS_INITIAL_WINDOW_SIZE => new_initial = Some(value as i64),
                        SETTINGS_MAX_FRAME_SIZE => {
                            self.max_frame = (value as usize).max(DEFAULT_MAX_FRAME)
                        }
                        _ => {}
                    }
                }
                if let Some(v) = new_initial {
                    // Applies to open streams too, by the difference (RFC 9113 §6.9.2).
                    self.send_stream += v - self.peer_initial;
                    self.peer_initial = v;
                }
                self.frame(SETTINGS, ACK, 0, &[]);
            }
            PING if flags & ACK == 0 => {
                let mut opaque = [0u8; 8];
                if len != 8 {
                    bail!("malformed PING frame from the server");
                }
                opaque.copy_from_slice(&self.rbuf[payload]);
                self.frame(PING, ACK, 0, &opaque);
            }
            GOAWAY => {
                let p = &self.rbuf[payload];
                let last = be32(p)? & 0x7fff_ffff;
                let code = be32(p.get(4..).unwrap_or_default())?;
                self.going_away = true;
                if code != 0 || (last < self.stream && !self.ended) {
                    bail!("the server closed the connection (GOAWAY, HTTP/2 error code {code:#x})");
                }
            }
            WINDOW_UPDATE => {
                let inc = (be32(&self.rbuf[payload])? & 0x7fff_ffff) as i64;
                if sid == 0 {
                    self.send_conn += inc;
                } else if sid == self.stream {
                    self.send_stream += inc;
                }
            }
            // Other streams' frames, PRIORITY, PUSH_PROMISE (disabled), CONTINUATION of
            // skipped headers, unknown types.
            _ => {}
        }
        Ok(())
    }

    /// Makes at least `n` unparsed bytes available.
    async fn fill(&mut self, n: usize) -> Result<()> {
        while self.rbuf.len() - self.rpos < n {
            if self.rpos > 0 {
                self.rbuf.drain(..self.rpos);
                self.rpos = 0;
            }
            self.rbuf.reserve(n.max(16 << 10));
            let read = self
                .io
                .read_buf(&mut self.rbuf)
                .await
                .context("read from the server")?;
            if read == 0 {
                bail!("the server closed the connection");
            }
        }
        Ok(())
    }

    fn frame_header(&mut self, len: usize, ty: u8, flags: u8, sid: u32) {
        let l = (len as u32).to_be_bytes();
        self.wbuf.extend_from_slice(&l[1..]);
        self.wbuf.push(ty);
        self.wbuf.push(flags);
        self.wbuf.extend_from_slice(&sid.to_be_bytes());
    }

    fn frame(&mut self, ty: u8, flags: u8, sid: u32, payload: &[u8]) {
        self.frame_header(payload.len(), ty, flags, sid);
        self.wbuf.extend_from_slice(payload);
    }

    fn window_update(&mut self, sid: u32, inc: u32) {
        self.frame(WINDOW_UPDATE, 0, sid, &inc.to_be_bytes());
    }
}

fn refused(path: &str) -> anyhow::Error {
    anyhow!(
        "{path}: the server answered without a message, i.e. with a gRPC error; \
         run with --client tonic to see its status"
    )
}

fn be32(b: &[u8]) -> Result<u32> {
    let b: [u8; 4] = b
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| anyhow!("truncated HTTP/2 frame from the server"))?;
    Ok(u32::from_be_bytes(b))
}

/// The payload of a DATA frame without its padding.
fn unpad(p: &[u8], flags: u8) -> Result<&[u8]> {
    if flags & PADDED == 0 {
        return Ok(p);
    }
    let pad = *p.first().ok_or_else(|| anyhow!("empty padded frame"))? as usize;
    p.get(1..p.len().saturating_sub(pad))
        .filter(|_| pad < p.len())
        .ok_or_else(|| anyhow!("padding longer than the frame"))
}

/// The request headers of a gRPC call, HPACK-encoded without the dynamic table or Huffman
/// coding (every field a literal or a static-table index), so no state is shared between
/// calls.
fn header_block(path: &str, authority: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(64 + path.len() + authority.len());
    b.push(0x80 | 3); // :method: POST (static index 3)
    b.push(0x80 | 6); // :scheme: http (static index 6)
    literal_indexed_name(&mut b, 4, path); // :path
    literal_indexed_name(&mut b, 1, authority); // :authority
    literal_indexed_name(&mut b, 31, "application/grpc"); // content-type
    b.push(0x00); // te: trailers (a new name, not indexed)
    string(&mut b, "te");
    string(&mut b, "trailers");
    b
}

/// "Literal header field without indexing — indexed name" (RFC 7541 §6.2.2).
fn literal_indexed_name(b: &mut Vec<u8>, index: usize, value: &str) {
    integer(b, 0x00, 4, index);
    string(b, value);
}

fn string(b: &mut Vec<u8>, s: &str) {
    integer(b, 0x00, 7, s.len());
    b.extend_from_slice(s.as_bytes());
}

/// An HPACK integer with an `n`-bit prefix (RFC 7541 §5.1).
fn integer(b: &mut Vec<u8>, first: u8, n: u32, mut v: usize) {
    let max = (1usize << n) - 1;
    if v < max {
        b.push(first | v as u8);
        return;
    }
    b.push(first | max as u8);
    v -= max;
    while v >= 128 {
        b.push((v % 128) as u8 | 0x80);
        v /= 128;
    }
    b.push(v as u8);
}

#[cfg(test)]
mod tests {
    use super::*;
    use automaton_proto::v1 as pb;

    /// The echo server (tonic, in this process) on a free port.
    async fn echo_server() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        tokio::spawn(crate::echo::serve_on(listener));
        addr
    }

    fn claim(task: String) -> pb::ClaimRequest {
        pb::ClaimRequest {
            task,
            agent: "a".into(),
            ttl: Some(automaton_proto::prost_types::Duration {
                seconds: 1,
                nanos: 0,
            }),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn unary_calls_follow_each_other_on_one_connection() {
        let mut c = Conn::connect(&echo_server().await).await.expect("connect");
        for i in 1..=200u64 {
            let lease: pb::Lease = c
                .unary("/automaton.v1.Leases/Claim", &claim(format!("t{i}")))
                .await
                .expect("claim");
            assert_eq!((lease.token, lease.task), (i, format!("t{i}")));
        }
    }

    #[tokio::test]
    async fn a_grpc_error_is_a_failed_call_and_the_connection_goes_on() {
        let mut c = Conn::connect(&echo_server().await).await.expect("connect");
        let refused = c
            .unary::<_, pb::AuditResponse>(
                "/automaton.v1.Tasks/Audit",
                &pb::AuditRequest::default(),
            )
            .await
            .expect_err("the echo server refuses Audit");
        assert!(
            format!("{refused}").contains("without a message"),
            "{refused}"
        );
        let unknown = c
            .unary::<_, pb::Lease>("/automaton.v1.Leases/NoSuchMethod", &claim("t".into()))
            .await
            .expect_err("unknown method");
        assert!(
            format!("{unknown}").contains("without a message"),
            "{unknown}"
        );
        let lease: pb::Lease = c
            .unary("/automaton.v1.Leases/Claim", &claim("t".into()))
            .await
            .expect("the connection still works");
        assert_eq!(lease.task, "t");
    }

    #[tokio::test]
    async fn messages_larger_than_every_window_wait_for_credit_both_ways() {
        // 3 MB each way: over the server's 1 MiB windows and, with a 100 kB receive window
        // here, over this client's too, so both sides' WINDOW_UPDATEs must flow.
        let mut c = Conn::connect_with_window(&echo_server().await, 100_000)
            .await
            .expect("connect");
        let big = "x".repeat(3 << 20);
        for _ in 0..2 {
            let lease: pb::Lease = c
                .unary("/automaton.v1.Leases/Claim", &claim(big.clone()))
                .await
                .expect("claim");
            assert_eq!(lease.task.len(), big.len());
        }
    }

    #[tokio::test]
    async fn a_stream_round_trips_past_the_windows_then_gives_way_to_unary_calls() {
        let mut c = Conn::connect_with_window(&echo_server().await, 100_000)
            .await
            .expect("connect");
        let id = "l".repeat(1000);
        let request = pb::KeepAliveRequest {
            lease_ids: vec![id.clone()],
        };
        c.open("/automaton.v1.Leases/KeepAlive").expect("open");
        for _ in 0..3000 {
            c.send_message(&request, false).await.expect("send");
            let r: pb::KeepAliveResponse = c.receive().await.expect("receive").expect("one");
            assert_eq!(r.lease_id, id);
        }
        // The stream is abandoned (RST_STREAM) by the next call.
        let lease: pb::Lease = c
            .unary("/automaton.v1.Leases/Claim", &claim("t".into()))
            .await
            .expect("claim after the stream");
        assert_eq!(lease.task, "t");
    }

    #[test]
    fn hpack_integers_match_rfc_7541_examples() {
        // C.1.1: 10 with a 5-bit prefix; C.1.2: 1337 with a 5-bit prefix.
        let mut b = Vec::new();
        integer(&mut b, 0, 5, 10);
        assert_eq!(b, [0x0a]);
        b.clear();
        integer(&mut b, 0, 5, 1337);
        assert_eq!(b, [0x1f, 0x9a, 0x0a]);
        b.clear();
        // content-type is static index 31: above a 4-bit prefix's 15.
        integer(&mut b, 0, 4, 31);
        assert_eq!(b, [0x0f, 0x10]);
    }

    #[test]
    fn padding_is_stripped_and_bad_padding_refused() {
        assert_eq!(unpad(&[2, b'a', b'b', 0, 0], PADDED).expect("ok"), b"ab");
        assert_eq!(unpad(b"ab", 0).expect("ok"), b"ab");
        assert!(unpad(&[9, b'a'], PADDED).is_err());
        assert!(unpad(&[], PADDED).is_err());
    }
}
