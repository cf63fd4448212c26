//! What one run of a real binary returned; shared by the cross-process test binaries
//! (`tests/status`, `tests/coordinator`), each of which includes this file.

#![allow(dead_code)]

use std::process::Output;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn ok(&self) -> &Self {
        assert_eq!(
            self.code, 0,
            "expected success:\nstdout: {}\nstderr: {}",
            self.stdout, self.stderr
        );
        self
    }

    pub fn code(&self, want: i32) -> &Self {
        assert_eq!(
            self.code, want,
            "exit code\nstdout: {}\nstderr: {}",
            self.stdout, self.stderr
        );
        self
    }

    /// The first line of stderr: the one-line error every refusal starts with.
    pub fn error_line(&self) -> &str {
        self.stderr.lines().next().unwrap_or("")
    }
}

impl From<Output> for Run {
    fn from(o: Output) -> Run {
        Run {
            code: o.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }
}
