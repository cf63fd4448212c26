//! The memory all uploads in flight may hold together (`max_upload_memory_bytes`): a
//! semaphore of bytes, taken as they arrive and given back as they are dropped.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::Status;

/// What all uploads in flight may hold in memory by default: two patches at their cap.
pub(crate) const DEFAULT_UPLOAD_MEMORY_BYTES: u64 = 512 << 20;

/// The bytes all uploads in flight may hold in memory together: a semaphore of bytes, taken
/// as they arrive, given back when the upload's bytes are dropped.
pub(crate) struct UploadBudget {
    bytes: Arc<Semaphore>,
    total: u64,
}

impl UploadBudget {
    pub(crate) fn new(total: u64) -> UploadBudget {
        let total = total.min(Semaphore::MAX_PERMITS as u64);
        UploadBudget {
            bytes: Arc::new(Semaphore::new(total as usize)),
            total,
        }
    }

    /// Takes `n` more bytes into `held`, or refuses the upload (which then drops `held`).
    pub(crate) fn take(
        &self,
        held: &mut Option<OwnedSemaphorePermit>,
        n: u64,
    ) -> Result<(), Status> {
        let refused = || {
            let busy = self.total - self.bytes.available_permits() as u64;
            Status::resource_exhausted(format!(
                "uploads in flight hold {busy} of the coordinator's {} bytes for uploads \
                 (max_upload_memory_bytes): retry this upload later, or send a smaller one",
                self.total
            ))
        };
        let n = u32::try_from(n).map_err(|_| refused())?;
        let permit = self
            .bytes
            .clone()
            .try_acquire_many_owned(n)
            .map_err(|_| refused())?;
        match held {
            Some(h) => h.merge(permit),
            None => *held = Some(permit),
        }
        Ok(())
    }
}
