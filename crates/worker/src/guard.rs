//! The agent's guard: a small process between the worker and the agent (this binary's hidden
//! `agent-guard` subcommand) that ends the agent's whole process group when the worker dies,
//! whatever killed it (SIGKILL, a crash, an OOM kill).
//!
//! The worker starts the guard in a new process group with stdin the read end of a pipe
//! whose write end only the worker holds and never writes to. The guard starts the agent as
//! its child, in the same group, and waits for whichever comes first:
//!
//! - the agent exits: the guard exits the same way, with the same exit code or by the same
//!   signal, so the worker judges the run as if it had started the agent itself;
//! - stdin reads EOF (or fails): the worker is gone, since the kernel closes a dead process's
//!   descriptors. The guard SIGTERMs its group, waits the grace, and SIGKILLs the group,
//!   itself included.
//!
//! SIGTERM and SIGINT are caught (and ignored) so that the worker's own stop sequence, sent to
//! the whole group, ends the agent and not the guard: the status the worker sees stays the
//! agent's. A caught signal is reset to its default by `exec`, so the agent is not affected;
//! an ignored one would be inherited, which is why this is a handler and not `SIG_IGN`.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::time::Duration;

use rustix::process::{Signal, kill_current_process_group};

/// The hidden subcommand that runs the guard.
pub const SUBCOMMAND: &str = "agent-guard";
/// The guard's exit code when it cannot start the agent (a shell's "cannot execute").
pub const CANNOT_START: i32 = 127;
/// How the one line the guard writes on stderr when it cannot start the agent begins; the
/// worker recognises it (with `CANNOT_START`) and reports that the agent could not start.
pub const CANNOT_START_LINE: &str = "automaton-worker agent-guard: cannot start the agent";
/// Prefix of the guard's own lines on stderr (they land in `agent.log`).
const ME: &str = "automaton-worker agent-guard";

enum Event {
    Exited(std::io::Result<ExitStatus>),
    WorkerGone,
}

/// Runs `command` (program and arguments) under the guard; returns the exit code to exit
/// with, or does not return (the agent died by a signal, or the worker is gone).
pub fn run(grace: Duration, command: &[OsString]) -> u8 {
    // A flag nobody reads: the handler is what matters (see the module doc).
    let caught = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        if let Err(e) = signal_hook::flag::register(sig, caught.clone()) {
            say(format_args!("cannot catch signal {sig}: {e}"));
        }
    }
    let Some((program, args)) = command.split_first() else {
        say(format_args!("no agent command given"));
        return 2;
    };
    let child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            let dir = std::env::current_dir()
                .map(|d| d.display().to_string())
                .unwrap_or_else(|_| "?".into());
            let _ = writeln!(std::io::stderr(), "{CANNOT_START_LINE} in {dir}: {e}");
            return CANNOT_START as u8;
        }
    };
    let (tx, rx) = mpsc::channel();
    let gone = tx.clone();
    // Blocks on stdin: the worker never writes, so the read returns only at its death.
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin();
        let mut buf = [0u8; 64];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        let _ = gone.send(Event::WorkerGone);
    });
    std::thread::spawn(move || {
        let _ = tx.send(Event::Exited(child.wait()));
    });
    match rx.recv() {
        Ok(Event::Exited(Ok(status))) => exit_like(status),
        Ok(Event::Exited(Err(e))) => {
            say(format_args!("cannot wait for the agent: {e}"));
            stop_group(grace, &rx)
        }
        Ok(Event::WorkerGone) | Err(_) => stop_group(grace, &rx),
    }
}

/// The worker is gone: SIGTERM the group, give the agent the grace (less if it ends sooner),
/// then SIGKILL the group, which ends this process too.
fn stop_group(grace: Duration, rx: &mpsc::Receiver<Event>) -> ! {
    let _ = kill_current_process_group(Signal::TERM);
    // Whatever of the group the agent leaves behind is killed once it is gone, as the worker
    // itself does.
    let _ = rx.recv_timeout(grace);
    let _ = kill_current_process_group(Signal::KILL);
    // Not reached: SIGKILL cannot be caught.
    std::process::exit(128 + 9)
}

/// Exits as the agent did: the same code, or death by the same signal.
fn exit_like(status: ExitStatus) -> u8 {
    if let Some(code) = status.code() {
        // An exit code is 0..=255 on Unix.
        return u8::try_from(code).unwrap_or(1);
    }
    let sig = status.signal().unwrap_or(Signal::KILL.as_raw());
    // Resets the signal's disposition (SIGTERM, SIGINT: this guard's handler; SIGPIPE: Rust's
    // SIG_IGN) to the default and raises it. It knows only the standard signals: a real-time
    // one (SIGRTMIN..) it refuses, and the guard never touched that one's disposition, so the
    // default holds and raising it is enough.
    if signal_hook::low_level::emulate_default_handler(sig).is_err() {
        let _ = signal_hook::low_level::raise(sig);
    }
    // A signal whose default is not to terminate cannot have killed the agent; be faithful to
    // the shell's convention if it did.
    u8::try_from(128 + sig).unwrap_or(1)
}

fn say(what: std::fmt::Arguments<'_>) {
    // Never a panic on a closed stderr: the worker may be gone.
    let _ = writeln!(std::io::stderr(), "{ME}: {what}");
}
