//! A minimal HTTP/1.1 client over `std::net::TcpStream`, enough to ask a model server on the
//! local network what it serves: GET, POST with a JSON body, `Connection: close`,
//! Content-Length, chunked transfer-encoding or read-to-EOF, a 1 MiB body cap, and one
//! deadline over connect, write and every read (a server that drips bytes cannot stretch it).

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::ProbeError;

/// A model server answers its metadata in a few KiB; more is not a model server.
pub const MAX_BODY: usize = 1 << 20;
const MAX_HEAD: usize = 64 << 10;

/// `http://host[:port][/prefix]`, split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Url {
    pub host: String,
    pub port: u16,
    pub prefix: String,
}

impl Url {
    pub fn parse(s: &str) -> Result<Url, ProbeError> {
        let bad = |why: &str| ProbeError::Url {
            url: s.to_string(),
            why: why.to_string(),
        };
        if s.starts_with("https://") {
            return Err(bad("https is not supported (plain http only)"));
        }
        let rest = s
            .strip_prefix("http://")
            .ok_or_else(|| bad("expected http://HOST[:PORT][/PATH]"))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || authority.starts_with('[') => {
                let port = p.parse::<u16>().map_err(|_| bad("bad port"))?;
                (h, port)
            }
            _ => (authority, 80),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(bad("no host"));
        }
        Ok(Url {
            host: host.to_string(),
            port,
            prefix: path.trim_end_matches('/').to_string(),
        })
    }
}

/// A response: status code and body (chunked encoding already removed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

/// One request; `body` is sent as `application/json` with POST, none means GET.
pub fn request(
    url: &Url,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> Result<Response, ProbeError> {
    let deadline = Instant::now() + timeout;
    let full_path = format!("{}{}", url.prefix, path);
    let remaining = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or(ProbeError::TimedOut(timeout))
    };
    let addrs: Vec<_> = (url.host.as_str(), url.port)
        .to_socket_addrs()
        .map_err(|e| ProbeError::Connect(format!("cannot resolve {}: {e}", url.host)))?
        .collect();
    let mut stream = None;
    let mut last = String::from("no address");
    for a in addrs {
        match TcpStream::connect_timeout(&a, remaining()?) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                return Err(ProbeError::TimedOut(timeout));
            }
            Err(e) => last = e.to_string(),
        }
    }
    let mut stream = stream.ok_or(ProbeError::Connect(last))?;
    let req = match body {
        Some(b) => format!(
            "POST {full_path} HTTP/1.1\r\nHost: {}:{}\r\nConnection: close\r\nAccept: application/json\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
            url.host,
            url.port,
            b.len()
        ),
        None => format!(
            "GET {full_path} HTTP/1.1\r\nHost: {}:{}\r\nConnection: close\r\nAccept: application/json\r\n\r\n",
            url.host, url.port
        ),
    };
    stream
        .set_write_timeout(Some(remaining()?))
        .map_err(io_err(timeout))?;
    stream.write_all(req.as_bytes()).map_err(io_err(timeout))?;

    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(resp) = complete(&buf, false)? {
            return Ok(resp);
        }
        stream
            .set_read_timeout(Some(remaining()?))
            .map_err(io_err(timeout))?;
        let n = stream.read(&mut chunk).map_err(io_err(timeout))?;
        if n == 0 {
            return complete(&buf, true)?.ok_or_else(|| {
                ProbeError::Http("connection closed before a full response".into())
            });
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_HEAD + MAX_BODY + 64 * 1024 {
            return Err(ProbeError::Http("response over 1 MiB".into()));
        }
    }
}

fn io_err(timeout: Duration) -> impl Fn(std::io::Error) -> ProbeError {
    move |e| match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => {
            ProbeError::TimedOut(timeout)
        }
        _ => ProbeError::Connect(e.to_string()),
    }
}

/// The response in `buf` if it is complete (`eof`: the server closed the connection).
fn complete(buf: &[u8], eof: bool) -> Result<Option<Response>, ProbeError> {
    let Some(head_end) = find(buf, b"\r\n\r\n") else {
        if buf.len() > MAX_HEAD {
            return Err(ProbeError::Http("headers over 64 KiB".into()));
        }
        return Ok(None);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .filter(|_| status_line.starts_with("HTTP/"))
        .ok_or_else(|| ProbeError::Http(format!("not an HTTP response: {:.60}", status_line)))?;
    let mut length = None;
    let mut chunked = false;
    for l in lines {
        let Some((k, v)) = l.split_once(':') else {
            continue;
        };
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
        if k == "content-length" {
            length = Some(
                v.parse::<usize>()
                    .map_err(|_| ProbeError::Http(format!("bad Content-Length {v:?}")))?,
            );
        } else if k == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked") {
            chunked = true;
        }
    }
    let body = &buf[head_end + 4..];
    if chunked {
        return Ok(dechunk(body)?.map(|body| Response { status, body }));
    }
    if let Some(n) = length {
        if n > MAX_BODY {
            return Err(ProbeError::Http("body over 1 MiB".into()));
        }
        if body.len() >= n {
            return Ok(Some(Response {
                status,
                body: body[..n].to_vec(),
            }));
        }
        if eof {
            return Err(ProbeError::Http("connection closed mid-body".into()));
        }
        return Ok(None);
    }
    if body.len() > MAX_BODY {
        return Err(ProbeError::Http("body over 1 MiB".into()));
    }
    Ok(eof.then(|| Response {
        status,
        body: body.to_vec(),
    }))
}

/// The decoded body once the terminating zero-size chunk has arrived; `None` until then.
fn dechunk(mut data: &[u8]) -> Result<Option<Vec<u8>>, ProbeError> {
    let mut out = Vec::new();
    loop {
        let Some(line_end) = find(data, b"\r\n") else {
            return Ok(None);
        };
        let size_text = String::from_utf8_lossy(&data[..line_end]);
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| ProbeError::Http(format!("bad chunk size {size_text:?}")))?;
        data = &data[line_end + 2..];
        if size == 0 {
            return Ok(Some(out));
        }
        if out.len() + size > MAX_BODY {
            return Err(ProbeError::Http("body over 1 MiB".into()));
        }
        if data.len() < size + 2 {
            return Ok(None);
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn url_parses_host_port_prefix_and_refuses_https() {
        let u = Url::parse("http://127.0.0.1:8000/").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.prefix.as_str()),
            ("127.0.0.1", 8000, "")
        );
        let u = Url::parse("http://gpu-a/llm").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.prefix.as_str()),
            ("gpu-a", 80, "/llm")
        );
        let e = Url::parse("https://x:1").unwrap_err().to_string();
        assert!(e.contains("plain http only"), "{e}");
    }

    #[test]
    fn content_length_chunked_and_eof_bodies_are_read() {
        let r = complete(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}extra",
            false,
        )
        .unwrap()
        .unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"{}"[..]));
        let c = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n4;x=1\r\n\":1}\r\n0\r\n\r\n";
        let r = complete(c, false).unwrap().unwrap();
        assert_eq!(r.body, b"{\"a\":1}");
        assert!(complete(&c[..c.len() - 7], false).unwrap().is_none());
        let e = b"HTTP/1.0 404 Not Found\r\n\r\nnope";
        assert!(complete(e, false).unwrap().is_none());
        let r = complete(e, true).unwrap().unwrap();
        assert_eq!((r.status, r.body.as_slice()), (404, &b"nope"[..]));
        assert!(complete(b"garbage\r\n\r\n", true).is_err());
    }
}
