//! A tiny OTLP/gRPC trace sink: takes every `Export`, counts the requests and spans, keeps
//! nothing. What a coordinator exports to while the benchmark measures the cost of export.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use tonic::{Request, Response, Status};

/// What a sink has received so far.
#[derive(Clone, Default)]
pub struct Counts {
    requests: Arc<AtomicU64>,
    spans: Arc<AtomicU64>,
}

impl Counts {
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }
    pub fn spans(&self) -> u64 {
        self.spans.load(Ordering::Relaxed)
    }
}

#[tonic::async_trait]
impl TraceService for Counts {
    async fn export(
        &self,
        req: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let n: usize = req
            .get_ref()
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum();
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.spans.fetch_add(n as u64, Ordering::Relaxed);
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// Serves a sink on `listen` in the background; its counts and `http://` URL.
pub async fn start(listen: std::net::SocketAddr) -> Result<(Counts, String)> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let addr = listener.local_addr()?;
    let counts = Counts::default();
    let server = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(counts.clone()))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    tokio::spawn(async move {
        if let Err(e) = server.await {
            eprintln!("the OTLP sink stopped: {e}");
        }
    });
    Ok((counts, format!("http://{addr}")))
}

/// `automaton-bench otlp-sink`: serves until Ctrl-C, printing its counts every 5 s.
pub async fn serve(listen: std::net::SocketAddr) -> Result<()> {
    let (counts, url) = start(listen).await?;
    println!("OTLP sink listening on {url}");
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
    loop {
        tokio::select! {
            _ = tick.tick() => eprintln!("{} spans in {} requests", counts.spans(), counts.requests()),
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}
