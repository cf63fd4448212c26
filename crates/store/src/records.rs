//! The line formats of `.state.lock`, `.state.approvals` and `.state.implementer`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use automaton_workflow::{AgentId, Phase, State};
use serde::{Deserialize, Serialize};

/// `t` within what RFC 3339 text (and protobuf's JSON mapping of a `Timestamp`) can hold:
/// 1970-01-01 to 9999-12-31T23:59:59.999999999Z. humantime panics outside it, and a computed
/// expiry or a time from the wire must not take a process down.
pub fn clamp_time(t: SystemTime) -> SystemTime {
    let last = UNIX_EPOCH + Duration::new(253_402_300_799, 999_999_999);
    t.clamp(UNIX_EPOCH, last)
}

/// `2026-06-14T14:30:00Z`: seconds precision, UTC, as the seeds write it. A time the format
/// cannot hold (before 1970, after 9999) is written as the nearest one it can.
pub fn format_time(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(clamp_time(t)).to_string()
}

/// `2026-06-14T14:30:00.123Z`: as `format_time`, to the millisecond (events).
pub fn format_time_millis(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(clamp_time(t)).to_string()
}

pub fn parse_time(s: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(s.trim().trim_end_matches('Z')).ok()
}

/// The highest fencing token a file may hold (`.state.lock`, the fencing mark): half the range,
/// so the additions that follow a read one (the next token, a reserved block) cannot overflow.
pub const MAX_TOKEN: u64 = i64::MAX as u64;

/// A task lease as mirrored in `.state.lock` (seed 001's four lines plus `lease:` and `token:`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub agent: AgentId,
    /// The task's state when the lease was granted.
    pub phase: State,
    #[serde(serialize_with = "ser_time", deserialize_with = "de_time")]
    pub claimed: SystemTime,
    #[serde(serialize_with = "ser_time", deserialize_with = "de_time")]
    pub expires: SystemTime,
    /// Empty for lock files written before leases had ids.
    pub lease_id: String,
    /// Fencing token; 0 for lock files written before tokens existed.
    pub token: u64,
}

fn ser_time<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&format_time(*t))
}

fn de_time<'de, D: serde::Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
    let s = String::deserialize(d)?;
    parse_time(&s).ok_or_else(|| serde::de::Error::custom(format!("'{s}' is not an RFC 3339 time")))
}

impl Lease {
    /// The lease as the lease rules see it.
    pub fn holder(&self) -> automaton_workflow::lease::Holder<'_> {
        automaton_workflow::lease::Holder {
            agent: &self.agent,
            lease_id: &self.lease_id,
            token: self.token,
        }
    }

    pub fn is_live(&self, now: SystemTime) -> bool {
        now < self.expires
    }

    pub fn render(&self) -> String {
        format!(
            "agent: {}\nphase: {}\nclaimed: {}\nexpires: {}\nlease: {}\ntoken: {}\n",
            self.agent,
            self.phase,
            format_time(self.claimed),
            format_time(self.expires),
            self.lease_id,
            self.token
        )
    }

    /// Reads a `.state.lock`; the error says which line or field is wrong.
    pub fn parse(text: &str) -> Result<Lease, String> {
        let (mut agent, mut phase, mut claimed, mut expires) = (None, None, None, None);
        let (mut lease_id, mut token) = (String::new(), 0u64);
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let (k, v) = line
                .split_once(':')
                .ok_or_else(|| format!("line {} is not 'key: value'", i + 1))?;
            let v = v.trim();
            match k.trim() {
                "agent" => agent = Some(v.parse::<AgentId>().map_err(|e| e.to_string())?),
                "phase" => {
                    phase = Some(
                        v.parse::<State>()
                            .map_err(|_| format!("unknown phase '{v}'"))?,
                    )
                }
                "claimed" => {
                    claimed = Some(parse_time(v).ok_or_else(|| format!("bad claimed time '{v}'"))?)
                }
                "expires" => {
                    expires = Some(parse_time(v).ok_or_else(|| format!("bad expires time '{v}'"))?)
                }
                "lease" => lease_id = v.to_string(),
                "token" => {
                    token = v
                        .parse()
                        .ok()
                        .filter(|t| *t <= MAX_TOKEN)
                        .ok_or_else(|| format!("bad token '{v}' (at most {MAX_TOKEN})"))?
                }
                other => return Err(format!("unknown key '{other}'")),
            }
        }
        Ok(Lease {
            agent: agent.ok_or("no 'agent:' line")?,
            phase: phase.ok_or("no 'phase:' line")?,
            claimed: claimed.ok_or("no 'claimed:' line")?,
            expires: expires.ok_or("no 'expires:' line")?,
            lease_id,
            token,
        })
    }

    /// Seconds left, for display.
    pub fn remaining(&self, now: SystemTime) -> Duration {
        self.expires.duration_since(now).unwrap_or_default()
    }
}

/// One line of `.state.approvals`: `{phase}:approved|{ISO-8601}|{approver}[|{sha256}]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Approval {
    pub phase: Phase,
    #[serde(serialize_with = "ser_time", deserialize_with = "de_time")]
    pub at: SystemTime,
    pub approver: String,
    /// sha256 of the approved artifact; absent in lines written before approvals were bound
    /// to content.
    pub sha256: Option<String>,
    /// The task branch's commit a code review's approval authorizes (issue 36: a review is
    /// bound to the revision it read); absent for other phases, for tasks without a branch,
    /// and in lines written before reviews were bound to commits.
    pub commit: Option<String>,
}

impl Approval {
    pub fn render(&self) -> String {
        let mut s = format!(
            "{}:approved|{}|{}",
            self.phase,
            format_time(self.at),
            self.approver
        );
        if self.sha256.is_some() || self.commit.is_some() {
            s.push('|');
            s.push_str(self.sha256.as_deref().unwrap_or_default());
        }
        if let Some(c) = &self.commit {
            s.push('|');
            s.push_str(c);
        }
        s.push('\n');
        s
    }

    pub fn parse_line(line: &str) -> Result<Approval, String> {
        let fields: Vec<&str> = line.split('|').collect();
        if !(3..=5).contains(&fields.len()) {
            return Err(format!(
                "expected 3 to 5 '|'-separated fields, found {}",
                fields.len()
            ));
        }
        let phase = fields[0]
            .strip_suffix(":approved")
            .and_then(|p| p.parse::<Phase>().ok())
            .filter(|p| p.is_gated())
            .ok_or_else(|| {
                format!(
                    "'{}' is not a '{{phase}}:approved' of a gated phase",
                    fields[0]
                )
            })?;
        let at = parse_time(fields[1])
            .ok_or_else(|| format!("'{}' is not an ISO-8601 time", fields[1]))?;
        let approver = fields[2].trim();
        if approver.is_empty() {
            return Err("the approver is empty".into());
        }
        let sha256 = match fields.get(3).map(|s| s.trim()) {
            None => None,
            // Empty only before a commit: a record bound to a commit but not to content.
            Some("") if fields.len() == 5 => None,
            Some(h) if h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()) => {
                Some(h.to_ascii_lowercase())
            }
            Some(h) => return Err(format!("'{h}' is not a sha256")),
        };
        let commit = match fields.get(4).map(|s| s.trim()) {
            None => None,
            Some(c) if is_commit_id(c) => Some(c.to_ascii_lowercase()),
            Some(c) => return Err(format!("'{c}' is not a commit id (40 or 64 hex digits)")),
        };
        Ok(Approval {
            phase,
            at,
            approver: approver.to_string(),
            sha256,
            commit,
        })
    }

    /// Every line of a log; `Err((line_number, why))` on the first bad one.
    pub fn parse_log(text: &str) -> Result<Vec<Approval>, (usize, String)> {
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| Approval::parse_line(l.trim_end()).map_err(|e| (i + 1, e)))
            .collect()
    }
}

/// A full git commit id: 40 hex digits (SHA-1) or 64 (SHA-256 repositories).
pub fn is_commit_id(c: &str) -> bool {
    matches!(c.len(), 40 | 64) && c.bytes().all(|b| b.is_ascii_hexdigit())
}

/// `.state.implementer`: every agent that has held the implement phase, one per line.
pub fn parse_implementers(text: &str) -> Result<Vec<AgentId>, (usize, String)> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            l.trim()
                .parse::<AgentId>()
                .map_err(|e| (i + 1, e.to_string()))
        })
        .collect()
}

/// `.state.holders`: every agent that held a lease on the task, per phase, one
/// `{phase}|{agent}` line each, in the order they first held it.
pub fn parse_holders(text: &str) -> Result<Vec<(Phase, AgentId)>, (usize, String)> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            let (phase, agent) = l
                .trim()
                .split_once('|')
                .ok_or_else(|| (i + 1, "expected '{phase}|{agent}'".to_string()))?;
            let phase = phase
                .parse::<Phase>()
                .map_err(|_| (i + 1, format!("'{phase}' is not a phase")))?;
            let agent = agent
                .parse::<AgentId>()
                .map_err(|e| (i + 1, e.to_string()))?;
            Ok((phase, agent))
        })
        .collect()
}

pub fn render_holders(holders: &[(Phase, AgentId)]) -> String {
    holders.iter().map(|(p, a)| format!("{p}|{a}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> SystemTime {
        parse_time(s).expect("valid time")
    }

    #[test]
    fn an_approval_line_names_its_commit_and_reads_back() {
        let c = "ab".repeat(20);
        let a = Approval {
            phase: Phase::CodeReview,
            at: t("2026-12-08T10:00:00Z"),
            approver: "ops".into(),
            sha256: Some("0".repeat(64)),
            commit: Some(c.clone()),
        };
        let line = a.render();
        assert_eq!(
            line,
            format!(
                "code_review:approved|2026-12-08T10:00:00Z|ops|{}|{c}\n",
                "0".repeat(64)
            )
        );
        assert_eq!(Approval::parse_line(line.trim_end()).expect("parse"), a);
        // Bound to a commit but not to content: the hash field stays, empty.
        let bare = Approval {
            sha256: None,
            ..a.clone()
        };
        assert_eq!(
            Approval::parse_line(bare.render().trim_end()).expect("parse"),
            bare
        );
        // A line of seed 004's three fields and one of the four before commits still read.
        for old in [
            "code_review:approved|2026-12-08T10:00:00Z|ops".to_string(),
            format!(
                "code_review:approved|2026-12-08T10:00:00Z|ops|{}",
                "0".repeat(64)
            ),
        ] {
            assert_eq!(Approval::parse_line(&old).expect("old line").commit, None);
        }
        for bad in [
            format!(
                "code_review:approved|2026-12-08T10:00:00Z|ops|{}|xyz",
                "0".repeat(64)
            ),
            format!("code_review:approved|2026-12-08T10:00:00Z|ops||{c}|more"),
            "code_review:approved|2026-12-08T10:00:00Z|ops|".to_string(),
        ] {
            assert!(Approval::parse_line(&bad).is_err(), "{bad}");
        }
    }
    #[test]
    fn lease_file_round_trips_with_seed_001_fields() {
        let lease = Lease {
            agent: "agent-1".parse().expect("valid"),
            phase: "implement".parse().expect("valid"),
            claimed: t("2026-06-14T14:30:00Z"),
            expires: t("2026-06-14T15:00:00Z"),
            lease_id: "0a1b2c".into(),
            token: 7,
        };
        let text = lease.render();
        assert_eq!(
            text,
            "agent: agent-1\nphase: implement\nclaimed: 2026-06-14T14:30:00Z\nexpires: 2026-06-14T15:00:00Z\nlease: 0a1b2c\ntoken: 7\n"
        );
        assert_eq!(Lease::parse(&text), Ok(lease));
    }

    #[test]
    fn lease_file_without_lease_and_token_is_read_as_legacy() {
        let l = Lease::parse("agent: a\nphase: research\nclaimed: 2026-06-14T14:30:00Z\nexpires: 2026-06-14T15:00:00Z\n")
            .expect("legacy lock");
        assert_eq!(l.token, 0);
    }

    #[test]
    fn times_the_format_cannot_hold_are_written_at_its_bounds() {
        let far = UNIX_EPOCH + Duration::from_secs(i64::MAX as u64 / 2);
        assert_eq!(format_time(far), "9999-12-31T23:59:59Z");
        let before = UNIX_EPOCH - Duration::from_secs(1);
        assert_eq!(format_time(before), "1970-01-01T00:00:00Z");
    }

    #[test]
    fn a_token_without_room_after_it_is_corrupt() {
        let lock = |token: &str| {
            Lease::parse(&format!(
                "agent: a\nphase: research\nclaimed: 2026-06-14T14:30:00Z\nexpires: 2026-06-14T15:00:00Z\ntoken: {token}\n"
            ))
        };
        assert_eq!(lock("9223372036854775807").map(|l| l.token), Ok(MAX_TOKEN));
        assert!(
            lock("18446744073709551615")
                .expect_err("no room for the next token")
                .contains("bad token")
        );
    }

    #[test]
    fn corrupt_lease_files_say_what_is_wrong() {
        assert!(Lease::parse("").expect_err("empty").contains("agent"));
        assert!(
            Lease::parse("garbage")
                .expect_err("garbage")
                .contains("line 1")
        );
        assert!(
            Lease::parse("agent: a\nphase: x\n")
                .expect_err("phase")
                .contains("unknown phase")
        );
    }

    #[test]
    fn holders_round_trip_and_bad_lines_are_named() {
        let h = vec![
            (Phase::Implement, "a".parse().expect("valid")),
            (Phase::CodeReview, "b".parse().expect("valid")),
        ];
        let text = render_holders(&h);
        assert_eq!(text, "implement|a\ncode_review|b\n");
        assert_eq!(parse_holders(&text), Ok(h));
        assert_eq!(parse_holders("implement|a\nnope").map_err(|e| e.0), Err(2));
        assert_eq!(parse_holders("reviewing|a").map_err(|e| e.0), Err(1));
    }

    #[test]
    fn approval_lines_with_three_or_four_fields() {
        let three =
            Approval::parse_line("research:approved|2026-06-14T14:30:00Z|user").expect("3 fields");
        assert_eq!(three.sha256, None);
        let sha = "a".repeat(64);
        let four = Approval::parse_line(&format!("design:approved|2026-06-14T15:00:00Z|bob|{sha}"))
            .expect("4 fields");
        assert_eq!(four.phase, Phase::Design);
        assert_eq!(
            four.render(),
            format!("design:approved|2026-06-14T15:00:00Z|bob|{sha}\n")
        );
        for bad in [
            "",
            "research|x|y",
            "implement:approved|2026-06-14T15:00:00Z|u",
            "research:approved|yesterday|u",
            "research:approved|2026-06-14T15:00:00Z|",
            "research:approved|2026-06-14T15:00:00Z|u|xyz",
        ] {
            assert!(Approval::parse_line(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            Approval::parse_log("research:approved|2026-06-14T14:30:00Z|user\n\nbroken\n")
                .map_err(|e| e.0),
            Err(3)
        );
    }
}
