//! What the engine refuses, and why: one error for the lease engine (and the coordinator
//! around it). The gRPC edge chooses the codes (`automaton_coordinator`'s `status`).

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Store(#[from] automaton_store::Error),
    #[error(
        "No live lease '{0}': it expired, was released, or never existed. Claim the task again."
    )]
    LeaseNotFound(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    PermissionDenied(String),
    /// Refused by a rule outside the store (a worker session's).
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("project is owned by another coordinator ({holder}); stop it first, or talk to it (see {})", path.display())]
    Owned {
        path: std::path::PathBuf,
        holder: String,
    },
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Internal(String),
    /// This coordinator cannot prove it still leads (`store = etcd`): nothing is answered.
    #[error("{0}")]
    NotLeading(String),
    /// The lease log cannot be written: the coordinator is stopping (fail-stop).
    #[error(
        "the coordinator cannot make changes durable ({0}); it is stopping: retry against its next start"
    )]
    Unavailable(String),
}
