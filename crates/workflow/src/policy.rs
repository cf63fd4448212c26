//! Project policy read from `.agent.md`: multi-agent mode, the lock timeout, which phases
//! are separated from their implementer, autopilot, and whether an implement run must change
//! code.

use std::time::Duration;

use crate::phase::Phase;

/// Lock timeout when `.agent.md` names none (seed 001).
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The effective policy of a project.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub multi_agent: bool,
    pub lock_timeout: Duration,
    /// Phases the implementer may neither claim nor approve (default: `code_review`).
    pub separated: Vec<Phase>,
    /// Seed 002's `Autopilot: Enabled` (default): drive every task to `complete` or
    /// `human_intervention`, and never create fix, review or tie-break tasks on its own.
    /// Disabled (manual mode): those follow-up tasks are created from verdicts.
    pub autopilot: bool,
    /// `Require code change: yes`: an implement run that changed no code (nothing, or only
    /// an agent tool's own state) fails (`agent_error`) instead of completing with a
    /// warning. Default: no.
    pub require_code_change: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            multi_agent: false,
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
            separated: vec![Phase::CodeReview],
            autopilot: true,
            require_code_change: false,
        }
    }
}

/// A value in `.agent.md` that cannot be read; the message says what to write instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error(
        "key 'Lock timeout' has the invalid value '{0}': write a number with a unit, e.g. 'Lock timeout: 30m' ('90s', '1h' and '30 minutes' work too)"
    )]
    LockTimeout(String),
    #[error(
        "key 'Separated phases' names '{0}', which is not a phase: list phase names separated by commas, e.g. 'Separated phases: code_review' (or 'none')"
    )]
    SeparatedPhase(String),
    #[error(
        "key 'Autopilot' has the invalid value '{0}': write 'Autopilot: Enabled' or 'Autopilot: Disabled'"
    )]
    Autopilot(String),
    #[error(
        "key 'Require code change' has the invalid value '{0}': write 'Require code change: yes' or 'Require code change: no'"
    )]
    RequireCodeChange(String),
}

/// The keys of one `.agent.md`, each `None` when the file does not set it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyFile {
    pub mode: Option<String>,
    pub lock_timeout: Option<Duration>,
    pub separated: Option<Vec<Phase>>,
    pub autopilot: Option<bool>,
    pub require_code_change: Option<bool>,
}

impl PolicyFile {
    /// Reads `Key: value` and `- **Key**: value` lines, keys in any case. Lines that name no
    /// known key are prose and ignored.
    pub fn parse(text: &str) -> Result<PolicyFile, PolicyError> {
        let mut out = PolicyFile::default();
        for line in text.lines() {
            let Some((key, value)) = key_value(line) else {
                continue;
            };
            match key.as_str() {
                "mode" => out.mode = Some(value.to_ascii_lowercase()),
                "lock timeout" | "lock-timeout" | "lock_timeout" => {
                    out.lock_timeout =
                        Some(parse_duration(&value).ok_or(PolicyError::LockTimeout(value))?);
                }
                "separated phases" | "separated-phases" | "separated_phases" => {
                    let phases = value
                        .split(',')
                        .map(str::trim)
                        .filter(|s| !s.is_empty() && *s != "none")
                        .map(|s| {
                            s.parse::<Phase>()
                                .map_err(|_| PolicyError::SeparatedPhase(s.into()))
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    out.separated = Some(phases);
                }
                "autopilot" => {
                    out.autopilot = Some(match value.to_ascii_lowercase().as_str() {
                        "enabled" | "on" | "yes" | "true" => true,
                        "disabled" | "off" | "no" | "false" => false,
                        _ => return Err(PolicyError::Autopilot(value)),
                    });
                }
                "require code change" | "require-code-change" | "require_code_change" => {
                    out.require_code_change = Some(match value.to_ascii_lowercase().as_str() {
                        "yes" | "true" | "on" | "enabled" => true,
                        "no" | "false" | "off" | "disabled" => false,
                        _ => return Err(PolicyError::RequireCodeChange(value)),
                    });
                }
                _ => {}
            }
        }
        Ok(out)
    }
}

impl Policy {
    /// The policy from the project's `.agent.md` laid over the user's `~/.automaton/.agent.md`:
    /// a key the project sets wins, one it does not set falls back to the user's file.
    pub fn layered(project: &PolicyFile, user: &PolicyFile) -> Policy {
        let d = Policy::default();
        let mode = project.mode.as_ref().or(user.mode.as_ref());
        Policy {
            multi_agent: mode
                .is_some_and(|m| m.starts_with("multi-agent") || m.starts_with("multi agent")),
            lock_timeout: project
                .lock_timeout
                .or(user.lock_timeout)
                .unwrap_or(d.lock_timeout),
            separated: project
                .separated
                .clone()
                .or_else(|| user.separated.clone())
                .unwrap_or(d.separated),
            autopilot: project.autopilot.or(user.autopilot).unwrap_or(d.autopilot),
            require_code_change: project
                .require_code_change
                .or(user.require_code_change)
                .unwrap_or(d.require_code_change),
        }
    }
}

fn key_value(line: &str) -> Option<(String, String)> {
    let line = line.trim().trim_start_matches(['-', '*', '+']).trim();
    let (key, value) = line.split_once(':')?;
    let key = key.replace(['*', '`'], "");
    let key = key.trim().to_ascii_lowercase();
    let value = value.trim().trim_start_matches("**").replace('`', "");
    let value = value.trim().trim_end_matches("**").trim().to_string();
    (!key.is_empty() && key.len() < 40).then_some((key, value))
}

/// The longest duration [`parse_duration`] accepts: 100 years. Callers add durations to the
/// clocks (`now + ttl`, a lease's view two TTLs ahead); longer ones overflow them, or pass the
/// year 9999 that times are written in.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 86_400);

/// `90s`, `30m`, `1h`, `2d`, `30 minutes`, `1 hour`; a bare number means minutes. At most
/// [`MAX_DURATION`].
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let secs = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "m" | "min" | "mins" | "minute" | "minutes" => n.checked_mul(60)?,
        "s" | "sec" | "secs" | "second" | "seconds" => n,
        "h" | "hr" | "hrs" | "hour" | "hours" => n.checked_mul(3600)?,
        "d" | "day" | "days" => n.checked_mul(86_400)?,
        _ => return None,
    };
    (secs > 0 && secs <= MAX_DURATION.as_secs()).then(|| Duration::from_secs(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_md_keys_read_in_both_forms_any_case() {
        let plain =
            PolicyFile::parse("# Agent\nMode: multi-agent\nLock timeout: 45m\n").expect("valid");
        let bold = PolicyFile::parse("- **mode**: Multi-Agent\n- **Lock Timeout**: 45 minutes\n")
            .expect("valid");
        assert_eq!(plain, bold);
        let p = Policy::layered(&plain, &PolicyFile::default());
        assert!(p.multi_agent);
        assert_eq!(p.lock_timeout, Duration::from_secs(45 * 60));
    }

    #[test]
    fn agent_md_project_overrides_user_key_by_key() {
        let project = PolicyFile::parse("Lock timeout: 10m").expect("valid");
        let user = PolicyFile::parse("Mode: multi-agent\nLock timeout: 2h").expect("valid");
        let p = Policy::layered(&project, &user);
        assert!(p.multi_agent, "mode falls back to the user's file");
        assert_eq!(p.lock_timeout, Duration::from_secs(600));
        let single = PolicyFile::parse("Mode: single-agent").expect("valid");
        assert!(!Policy::layered(&single, &user).multi_agent);
    }

    #[test]
    fn agent_md_defaults_when_unset() {
        let p = Policy::layered(&PolicyFile::default(), &PolicyFile::default());
        assert_eq!(p, Policy::default());
        assert_eq!(p.lock_timeout, Duration::from_secs(1800));
        assert_eq!(p.separated, vec![Phase::CodeReview]);
    }

    #[test]
    fn agent_md_separated_phases_configurable() {
        let f = PolicyFile::parse("Separated phases: code_review, bug_find").expect("valid");
        assert_eq!(f.separated, Some(vec![Phase::CodeReview, Phase::BugFind]));
        assert_eq!(
            PolicyFile::parse("Separated phases: none")
                .expect("valid")
                .separated,
            Some(vec![])
        );
        assert!(PolicyFile::parse("Separated phases: reviewing").is_err());
    }

    #[test]
    fn agent_md_autopilot_is_enabled_unless_disabled() {
        let p = |t: &str| {
            Policy::layered(
                &PolicyFile::parse(t).expect("valid"),
                &PolicyFile::default(),
            )
        };
        assert!(p("").autopilot);
        assert!(!p("- **Autopilot**: Disabled").autopilot);
        assert!(p("Autopilot: Enabled").autopilot);
        assert!(PolicyFile::parse("Autopilot: sometimes").is_err());
    }

    #[test]
    fn agent_md_require_code_change_is_off_unless_set() {
        let p = |t: &str| {
            Policy::layered(
                &PolicyFile::parse(t).expect("valid"),
                &PolicyFile::default(),
            )
        };
        assert!(!p("").require_code_change);
        assert!(p("Require code change: yes").require_code_change);
        assert!(p("- **Require code change**: true").require_code_change);
        assert!(!p("require_code_change: no").require_code_change);
        let e = PolicyFile::parse("Require code change: maybe").expect_err("invalid");
        assert_eq!(
            e.to_string(),
            "key 'Require code change' has the invalid value 'maybe': write 'Require code change: yes' or 'Require code change: no'"
        );
    }

    #[test]
    fn lock_timeout_units() {
        let d = |s| parse_duration(s).map(|d| d.as_secs());
        assert_eq!(d("90s"), Some(90));
        assert_eq!(d("30m"), Some(1800));
        assert_eq!(d("1h"), Some(3600));
        assert_eq!(d("30 minutes"), Some(1800));
        assert_eq!(d("2 hours"), Some(7200));
        assert_eq!(d("30"), Some(1800), "bare number means minutes");
        assert_eq!(d("36500d"), Some(MAX_DURATION.as_secs()));
        for bad in [
            "",
            "m",
            "0",
            "-5m",
            "5 fortnights",
            "1.5h",
            "36501d",
            "213503982334601d",
        ] {
            assert_eq!(d(bad), None, "{bad:?}");
        }
        assert!(PolicyFile::parse("Lock timeout: soon").is_err());
    }
}
