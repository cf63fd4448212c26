//! The `Work` service: what a worker does under an assignment's lease — fetch its inputs,
//! upload the artifact and the code, complete the phase. Every call presents the lease id and
//! its fencing token; a caller bound to a name must be the lease's holder. Writes are fenced:
//! the lease is checked again under the task's guard right before the bytes land, so nothing
//! sent under a lease that has ended reaches the folder or the branch.
//!
//! Memory: every upload in flight takes its bytes from one [`UploadBudget`] as they arrive
//! (an artifact its announced size at once) and gives them back when it ends; an upload that
//! would pass the budget is refused `RESOURCE_EXHAUSTED` at once, never queued. So the bytes
//! held for uploads never pass `max_upload_memory_bytes`, however many streams are open.
//!
//! Retries: a worker retries a call whose answer it lost. The same artifact again is answered
//! as before (`unchanged`); the same patch again finds its commit at the branch head and
//! answers with it (see `Project::apply_changes`); the same completion again, its lease now
//! ended, is answered from the record its transition left (`Project::completion`).

use std::sync::Arc;

use automaton_engine::{Live, Presented};
use automaton_proto::v1 as pb;
use automaton_store::InputFile;
use automaton_workflow::{AgentId, Artifact, EventKind, State, TaskName, sha256_hex};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::field::Empty;

use crate::Error;
use crate::IntoStatus;
use crate::auth::caller;
use crate::service::Service;
use crate::state::Coordinator;
use crate::wire::bound_agent;

/// Bytes per `FileData` message (well under the message limit).
const CHUNK: usize = 1 << 20;
/// A patch may change at most this many files, with at most this much content.
const MAX_PATCH_FILES: usize = 10_000;
const MAX_PATCH_BYTES: u64 = 256 << 20;
/// The task file a review phase finds the change in.
const CHANGES_DIFF: &str = "changes.diff";

/// The lease's phase's artifact.
fn artifact_of(l: &Live) -> Result<Artifact, Status> {
    l.state.phase.artifact().ok_or_else(|| {
        Error::Refused(format!(
            "'{}' has no deliverable in {}: nothing to upload",
            l.task, l.state
        ))
        .into_status()
    })
}

/// An artifact name as sent: one plain file name, nothing hidden, no path.
fn plain_name(name: &str) -> Result<&str, Status> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && !name.contains(['/', '\\', '\0'])
        && name != ".."
        && name.chars().all(|c| c.is_ascii_graphic());
    if ok {
        Ok(name)
    } else {
        Err(Error::Invalid(format!(
            "'{}' is not an artifact name: send the phase's file name, e.g. SPEC.md (no path, no hidden file)",
            automaton_workflow::excerpt(name)
        ))
        .into_status())
    }
}

impl Coordinator {
    /// Runs `f` on the project under `task`'s guard, if the lease `lease_id` with `token` is
    /// still `task`'s live lease at that moment: the fence for every write a worker makes.
    pub(crate) async fn under_lease<T: Send + 'static>(
        self: &Arc<Self>,
        task: &TaskName,
        lease_id: &str,
        token: u64,
        f: impl FnOnce(&automaton_store::Project) -> Result<T, automaton_store::Error> + Send + 'static,
    ) -> Result<T, Error> {
        let (t, id) = (task.clone(), lease_id.to_string());
        self.engine
            .to_completion(task, move |c| async move {
                let current = c.live_of(&t);
                if current
                    .as_ref()
                    .is_none_or(|l| l.lease_id != id || l.token != token)
                {
                    return Err(Error::Store(automaton_store::Error::StaleToken {
                        task: t.clone(),
                        given: token,
                        current: current.map(|l| l.token),
                    }));
                }
                let project = c.project().clone();
                tokio::task::spawn_blocking(move || f(&project))
                    .await
                    .map_err(|e| Error::Internal(format!("a fenced write failed: {e}")))?
                    .map_err(Error::from)
            })
            .await
    }
}

type Stream<T> = ReceiverStream<Result<T, Status>>;

/// The lease a Work call acts under, on the call's span.
fn on_lease(l: &Live) {
    let span = tracing::Span::current();
    span.record("automaton.task", tracing::field::display(&l.task));
    span.record("automaton.phase", tracing::field::display(&l.state));
    span.record("automaton.agent", l.agent.as_str());
    span.record("automaton.lease_id", l.lease_id.as_str());
    span.record("automaton.token", l.token);
}

/// A Work call's span, named `$name`: the handler fills in the lease's fields (`record_lease`)
/// once it knows them, and a detail.
macro_rules! work_span {
    ($name:literal) => {
        tracing::info_span!(
            $name,
            automaton.task = Empty,
            automaton.phase = Empty,
            automaton.agent = Empty,
            automaton.lease_id = Empty,
            automaton.token = Empty,
            automaton.detail = Empty,
        )
    };
}

/// Runs a Work call in `span`, its error recorded there.
async fn traced<T>(
    span: tracing::Span,
    call: impl std::future::Future<Output = Result<T, Status>>,
) -> Result<T, Status> {
    use tracing::Instrument;
    let r = call.instrument(span.clone()).await;
    if let Err(s) = &r {
        automaton_telemetry::trace::record_error(
            &span,
            &format!("{:?}: {}", s.code(), s.message()),
        );
    }
    r
}

#[tonic::async_trait]
impl pb::work_server::Work for Service {
    type FetchWorkspaceStream = Stream<pb::WorkspaceChunk>;

    async fn fetch_workspace(
        &self,
        req: Request<pb::FetchWorkspaceRequest>,
    ) -> Result<Response<Self::FetchWorkspaceStream>, Status> {
        traced(
            work_span!("work.fetch_workspace"),
            self.fetch_workspace_in(req),
        )
        .await
    }

    async fn upload_artifact(
        &self,
        req: Request<Streaming<pb::ArtifactChunk>>,
    ) -> Result<Response<pb::UploadResult>, Status> {
        traced(
            work_span!("work.upload_artifact"),
            self.upload_artifact_in(req),
        )
        .await
    }

    async fn upload_patch(
        &self,
        req: Request<Streaming<pb::PatchChunk>>,
    ) -> Result<Response<pb::PatchResult>, Status> {
        traced(work_span!("work.upload_patch"), self.upload_patch_in(req)).await
    }

    async fn complete_phase(
        &self,
        req: Request<pb::CompletePhaseRequest>,
    ) -> Result<Response<pb::CompletePhaseResponse>, Status> {
        traced(
            work_span!("work.complete_phase"),
            self.complete_phase_in(req),
        )
        .await
    }

    async fn stream_output(
        &self,
        req: Request<Streaming<pb::OutputChunk>>,
    ) -> Result<Response<pb::StreamOutputResponse>, Status> {
        crate::output::stream_output(&self.coord.engine, &self.outputs, req).await
    }
}

impl Service {
    async fn fetch_workspace_in(
        &self,
        req: Request<pb::FetchWorkspaceRequest>,
    ) -> Result<Response<Stream<pb::WorkspaceChunk>>, Status> {
        let who = bound_agent(&caller(&req))?;
        let r = req.into_inner();
        let l = self
            .coord
            .engine
            .lease_for_work(&r.lease_id, r.token, who.as_ref())
            .await
            .map_err(crate::status)?;
        on_lease(&l);
        let (task, phase) = (l.task.clone(), l.state.phase);
        let cached = r.cached_commits;
        let (inputs, head, code, base) = self
            .coord
            .engine
            .read(move |p| {
                let mut inputs = p.work_inputs(&task, phase)?;
                let head = p.task_branch(&task)?;
                let code = match &head {
                    Some(h) if !cached.contains(&h.commit) => Some(p.read_tree(&h.commit)?),
                    _ => None,
                };
                // A review is given the change it reviews, and where the change started.
                let mut base = String::new();
                if phase.reviews_code()
                    && let Some(c) = p.task_changes(&task)?
                {
                    base = c.base;
                    inputs.push(InputFile {
                        kind: "task",
                        path: CHANGES_DIFF.into(),
                        content: c.diff,
                    });
                }
                Ok((inputs, head, code, base))
            })
            .await
            .map_err(crate::status)?;
        // What the run read (issue 36: a review is bound to the commit it reviewed).
        if let Some(h) = &head {
            self.coord.work.served(&l.task, l.token, &h.commit);
        }
        let mut files = Vec::new();
        let mut bodies: Vec<(&'static str, String, Vec<u8>)> = Vec::new();
        for InputFile {
            kind,
            path,
            content,
        } in inputs
        {
            files.push(pb::WorkspaceFile {
                kind: kind.into(),
                path: path.clone(),
                size: content.len() as u64,
                sha256: sha256_hex(&content),
                executable: false,
            });
            bodies.push((kind, path, content));
        }
        let code_included = code.is_some();
        for f in code.into_iter().flatten() {
            files.push(pb::WorkspaceFile {
                kind: "code".into(),
                path: f.path.clone(),
                size: f.content.len() as u64,
                sha256: sha256_hex(&f.content),
                executable: f.executable,
            });
            bodies.push(("code", f.path, f.content));
        }
        let manifest = pb::WorkspaceManifest {
            task: l.task.to_string(),
            phase: l.state.to_string(),
            commit: head.as_ref().map(|h| h.commit.clone()).unwrap_or_default(),
            branch: head.map(|h| h.branch).unwrap_or_default(),
            code_included,
            files,
            base_commit: base,
        };
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            let first = pb::WorkspaceChunk {
                part: Some(pb::workspace_chunk::Part::Manifest(manifest)),
            };
            if tx.send(Ok(first)).await.is_err() {
                return;
            }
            for (kind, path, content) in bodies {
                let mut offset = 0usize;
                // Empty files need no data message: the manifest says their size is 0.
                while offset < content.len() {
                    let end = (offset + CHUNK).min(content.len());
                    let chunk = pb::WorkspaceChunk {
                        part: Some(pb::workspace_chunk::Part::Data(pb::FileData {
                            kind: kind.into(),
                            path: path.clone(),
                            offset: offset as u64,
                            data: content[offset..end].to_vec(),
                        })),
                    };
                    if tx.send(Ok(chunk)).await.is_err() {
                        return;
                    }
                    offset = end;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn upload_artifact_in(
        &self,
        req: Request<Streaming<pb::ArtifactChunk>>,
    ) -> Result<Response<pb::UploadResult>, Status> {
        let who = bound_agent(&caller(&req))?;
        let limit = self.coord.work.max_artifact_bytes;
        let mut chunks = req.into_inner();
        let Some(first) = chunks.message().await? else {
            return Err(Status::invalid_argument(
                "an empty upload: send the lease, the name, the sha256 and the size first",
            ));
        };
        let name = plain_name(&first.name)?.to_string();
        let l = self
            .coord
            .engine
            .lease_for_work(&first.lease_id, first.token, who.as_ref())
            .await
            .map_err(crate::status)?;
        on_lease(&l);
        let artifact = artifact_of(&l)?;
        if name != artifact.file_name() {
            return Err(Error::Refused(format!(
                "'{name}' is not the artifact of {} (the lease's phase): upload {}",
                l.state,
                artifact.file_name()
            ))
            .into_status());
        }
        if first.size > limit {
            return Err(Status::resource_exhausted(format!(
                "{name} is {} bytes; artifacts are limited to {limit} bytes (max_artifact_bytes)",
                first.size
            )));
        }
        let more = || {
            Status::resource_exhausted(format!(
                "{name}: more bytes than the {} announced (limit {limit})",
                first.size
            ))
        };
        // The announced size is taken from the budget at once, and the buffer holds no more.
        let mut held = None;
        self.coord.uploads.take(&mut held, first.size)?;
        let mut bytes = first.data;
        if bytes.len() as u64 > first.size {
            return Err(more());
        }
        bytes.reserve_exact(first.size as usize - bytes.len());
        while let Some(c) = chunks.message().await? {
            if bytes.len() as u64 + c.data.len() as u64 > first.size {
                return Err(more());
            }
            bytes.extend_from_slice(&c.data);
        }
        if bytes.len() as u64 != first.size {
            return Err(Status::invalid_argument(format!(
                "{name}: {} bytes arrived, {} were announced: upload it again",
                bytes.len(),
                first.size
            )));
        }
        let sum = sha256_hex(&bytes);
        if !sum.eq_ignore_ascii_case(&first.sha256) {
            return Err(Status::invalid_argument(format!(
                "{name}: the bytes have sha256 {sum}, not the {} sent: upload it again",
                automaton_workflow::excerpt(&first.sha256)
            )));
        }
        if name.ends_with(".md") && std::str::from_utf8(&bytes).is_err() {
            return Err(Status::invalid_argument(format!(
                "{name} is not UTF-8 text: markdown artifacts must be UTF-8"
            )));
        }
        let size = bytes.len() as u64;
        let task = l.task.clone();
        let changed = self
            .coord
            .under_lease(&l.task, &l.lease_id, l.token, move |p| {
                // The budget is given back with the bytes, even if the call is dropped.
                let _held = held;
                p.write_artifact(&task, artifact, &bytes)
            })
            .await
            .map_err(crate::status)?;
        tracing::Span::current().record(
            "automaton.detail",
            format!(
                "{name} ({size} bytes{})",
                if changed { "" } else { ", unchanged" }
            ),
        );
        self.coord.engine.emit(
            EventKind::ArtifactUploaded,
            &l.task.to_string(),
            l.agent.as_str(),
            l.token,
            format!(
                "{name} ({size} bytes){}",
                if changed { "" } else { ", unchanged" }
            ),
        );
        Ok(Response::new(pb::UploadResult {
            name,
            size,
            sha256: sum,
            unchanged: !changed,
        }))
    }

    async fn upload_patch_in(
        &self,
        req: Request<Streaming<pb::PatchChunk>>,
    ) -> Result<Response<pb::PatchResult>, Status> {
        let who = bound_agent(&caller(&req))?;
        let mut chunks = req.into_inner();
        let Some(first) = chunks.message().await? else {
            return Err(Status::invalid_argument(
                "an empty patch upload: send the lease and the base commit first",
            ));
        };
        let l = self
            .coord
            .engine
            .lease_for_work(&first.lease_id, first.token, who.as_ref())
            .await
            .map_err(crate::status)?;
        on_lease(&l);
        if !l.state.phase.allows_code_edits() {
            return Err(Error::Refused(format!(
                "{} may not change code (only implement and doc_review may): upload no patch",
                l.state
            ))
            .into_status());
        }
        let base = first.base_commit.clone();
        if base.len() > 64 || !base.bytes().all(|b| b.is_ascii_hexdigit()) || base.is_empty() {
            return Err(Status::invalid_argument(format!(
                "base commit '{}' is not a commit id: send the manifest's commit",
                automaton_workflow::excerpt(&base)
            )));
        }
        let mut changes: Vec<automaton_store::Change> = Vec::new();
        let mut total = 0u64;
        let mut open = false;
        let mut next = first.change;
        // What this patch holds of the upload budget: its content and paths so far.
        let mut held = None;
        loop {
            if let Some(c) = next.take() {
                total += c.data.len() as u64;
                if total > MAX_PATCH_BYTES {
                    return Err(Status::resource_exhausted(format!(
                        "the patch is larger than {MAX_PATCH_BYTES} bytes: send the change in \
                         smaller patches"
                    )));
                }
                let continues = open && changes.last().is_some_and(|p| p.path == c.path);
                let kept = c.data.len() + if continues { 0 } else { c.path.len() };
                self.coord.uploads.take(&mut held, kept as u64)?;
                if continues {
                    if let Some(p) = changes.last_mut() {
                        p.content.extend_from_slice(&c.data);
                    }
                } else {
                    if changes.len() >= MAX_PATCH_FILES {
                        return Err(Status::resource_exhausted(format!(
                            "the patch changes more than {MAX_PATCH_FILES} files"
                        )));
                    }
                    changes.push(automaton_store::Change {
                        path: c.path,
                        deleted: c.deleted,
                        executable: c.executable,
                        content: c.data,
                    });
                }
                open = !c.deleted && !c.last;
            }
            match chunks.message().await? {
                Some(m) => next = m.change,
                None => break,
            }
        }
        let (task, author) = (l.task.clone(), l.agent.to_string());
        let message = format!(
            "{}: {} by {} (fencing token {})",
            l.task, l.state, l.agent, l.token
        );
        let n = changes.len();
        let applied = self
            .coord
            .under_lease(&l.task, &l.lease_id, l.token, move |p| {
                let _held = held;
                p.apply_changes(&task, &base, &changes, &author, &message)
            })
            .await
            .map_err(crate::status)?;
        tracing::Span::current().record(
            "automaton.detail",
            format!(
                "{} on {} ({n} files)",
                applied.commit.as_deref().unwrap_or("no change"),
                applied.branch
            ),
        );
        if let Some(c) = &applied.commit {
            // The fleet's own commit: the reviews after it read it, and are bound to it.
            self.coord.work.wrote(&l.task, l.token, c);
            self.coord.engine.emit(
                EventKind::CodeCommitted,
                &l.task.to_string(),
                l.agent.as_str(),
                l.token,
                format!("{} on {} ({n} files)", c, applied.branch),
            );
        }
        Ok(Response::new(pb::PatchResult {
            commit: applied.commit.unwrap_or_default(),
            branch: applied.branch,
            files_changed: applied.files_changed,
        }))
    }

    /// The answer to a completion whose lease has ended, if ending it is what this very
    /// completion did: a retry whose first answer was lost. The lease's record must name the
    /// token presented (and the caller, when bound to a name), and the target asked for, if
    /// any. Anything else is answered as any call under an ended lease.
    async fn completed_before(
        &self,
        r: &pb::CompletePhaseRequest,
        who: Option<&AgentId>,
    ) -> Result<Option<pb::CompletePhaseResponse>, Status> {
        let id = r.lease_id.clone();
        let Some(done) = self
            .coord
            .engine
            .read(move |p| p.completion(&id))
            .await
            .map_err(crate::status)?
        else {
            return Ok(None);
        };
        let same_target = r.target.is_empty() || r.target.parse::<State>().ok() == Some(done.to);
        if done.token != r.token || who.is_some_and(|a| *a != done.agent) || !same_target {
            return Ok(None);
        }
        let span = tracing::Span::current();
        span.record("automaton.task", tracing::field::display(&done.task));
        span.record("automaton.agent", done.agent.as_str());
        span.record("automaton.lease_id", done.lease_id.as_str());
        span.record("automaton.token", done.token);
        span.record(
            "automaton.detail",
            format!("{} → {} (done already: a retry)", done.from, done.to),
        );
        Ok(Some(pb::CompletePhaseResponse {
            task: done.task.to_string(),
            from: done.from.to_string(),
            to: done.to.to_string(),
        }))
    }

    async fn complete_phase_in(
        &self,
        req: Request<pb::CompletePhaseRequest>,
    ) -> Result<Response<pb::CompletePhaseResponse>, Status> {
        let who = bound_agent(&caller(&req))?;
        let r = req.into_inner();
        let l = match self
            .coord
            .engine
            .lease_for_work(&r.lease_id, r.token, who.as_ref())
            .await
        {
            Ok(l) => l,
            Err(e @ Error::LeaseNotFound(_)) => {
                return match self.completed_before(&r, who.as_ref()).await? {
                    Some(done) => Ok(Response::new(done)),
                    None => Err(e.into_status()),
                };
            }
            Err(e) => return Err(e.into_status()),
        };
        on_lease(&l);
        let target: State =
            if r.target.is_empty() {
                let verdict = if l.state.phase == automaton_workflow::Phase::Referee {
                    // Through the store: never a link, a FIFO or a file without end.
                    let task = l.task.clone();
                    self.coord
                        .engine
                        .read(move |p| p.read_artifact_text(&task, Artifact::Verdict))
                        .await
                        .map_err(crate::status)?
                } else {
                    None
                };
                automaton_workflow::progress::after_work(l.state, verdict.as_deref())
                    .ok_or_else(|| {
                        Error::Refused(format!("{} has no next phase to complete into", l.state))
                    })
                    .map_err(crate::status)?
            } else {
                r.target.parse().map_err(|_| {
                Error::Invalid(format!(
                    "'{}' is not a phase: leave target empty for the lifecycle's next state",
                    automaton_workflow::excerpt(&r.target)
                ))
            }).map_err(crate::status)?
            };
        let presented = Presented {
            agent: Some(l.agent.clone()),
            lease_id: Some(l.lease_id.clone()),
            token: Some(l.token),
        };
        let (from, _) = self
            .coord
            .engine
            .transition(&l.task, target, &presented)
            .await
            .map_err(crate::status)?;
        tracing::Span::current().record("automaton.detail", format!("{from} → {target}"));
        Ok(Response::new(pb::CompletePhaseResponse {
            task: l.task.to_string(),
            from: from.to_string(),
            to: target.to_string(),
        }))
    }
}
