//! Arbitrary and mutated bytes against a parser, every panic caught and reported with the
//! case that caused it. No fuzzing crate: a seeded splitmix64, so a run is reproducible and
//! the build stays small. Shared by the workflow, store and coordinator tests (`#[path]`).
//!
//! `AUTOMATON_FUZZ_ITERS` sets the cases per parser (default 20 000), `AUTOMATON_FUZZ_SEED`
//! the base seed; `cargo test fuzz -- --nocapture` prints the figures.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Once;

/// splitmix64.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }

    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// What breaks parsers: huge, negative and float numbers, years past 9999 and before 1970,
/// separators of every line format, control bytes, invalid and odd UTF-8.
const NASTY: &[&str] = &[
    "18446744073709551615",
    "18446744073709551616",
    "9223372036854775807",
    "9007199254740992",
    "99999999999999999999",
    "-1",
    "-0",
    "+5",
    "0",
    "1e9",
    "0x10",
    "1.5",
    "+275760-09-13T00:00:00Z",
    "99999-01-01T00:00:00Z",
    "9999-12-31T23:59:60Z",
    "1969-12-31T23:59:59Z",
    "0000-00-00T00:00:00Z",
    "2026-02-29T24:00:00Z",
    "2026-06-14T14:30:00.999999999999Z",
    "2026-06-14T14:30:00+00:00",
    "",
    "\t",
    "|",
    ":",
    " ",
    "\0",
    "\n",
    "\r\n",
    "\r",
    "/",
    ".",
    "..",
    "**",
    "_",
    "`",
    "#",
    "é",
    "\u{85}",
    "\u{2028}",
    "\u{feff}",
];

/// Invalid UTF-8: lone continuation, truncated sequences, a surrogate, an overlong NUL.
const BAD_UTF8: &[&[u8]] = &[
    b"\xff",
    b"\x80",
    b"\xc3",
    b"\xe2\x82",
    b"\xed\xa0\x80",
    b"\xc0\x80",
];

fn is_delim(b: u8) -> bool {
    matches!(b, b':' | b'|' | b'\t' | b'\n' | b' ' | b',' | b'/' | b'-')
}

/// One to eight mutations of a valid example: bit flips, inserts, deletes, nasty tokens,
/// whole fields replaced, splices from other examples, repeats and very long lines.
pub fn mutate(rng: &mut Rng, seeds: &[&str], words: &[&str]) -> Vec<u8> {
    let mut b = rng.pick(seeds).as_bytes().to_vec();
    // Half the cases one mutation (most get past the first checks), the rest up to eight.
    let n = if rng.below(2) == 0 {
        1
    } else {
        1 + rng.below(8)
    };
    for _ in 0..n {
        let at = rng.below(b.len() + 1);
        let token: Vec<u8> = match rng.below(3) {
            0 => rng.pick(NASTY).as_bytes().to_vec(),
            1 if !words.is_empty() => rng.pick(words).as_bytes().to_vec(),
            _ => rng.pick(BAD_UTF8).to_vec(),
        };
        match rng.below(10) {
            0 if at < b.len() => b[at] ^= 1 << rng.below(8),
            1 => b.insert(at, rng.next() as u8),
            2 => drop(b.drain(at..(at + rng.below(16)).min(b.len()))),
            3 | 4 => drop(b.splice(at..at, token)),
            5 => {
                // Replace the field around `at` (between two delimiters).
                let start = b[..at]
                    .iter()
                    .rposition(|&c| is_delim(c))
                    .map_or(0, |i| i + 1);
                let end = b[at..]
                    .iter()
                    .position(|&c| is_delim(c))
                    .map_or(b.len(), |i| at + i);
                drop(b.splice(start.min(end)..end, token));
            }
            6 => {
                let other = rng.pick(seeds).as_bytes();
                let from = rng.below(other.len() + 1);
                let to = (from + rng.below(other.len() + 1)).min(other.len());
                drop(b.splice(at..at, other[from..to].iter().copied()));
            }
            7 => {
                let len = rng.below(b.len() - at + 1).min(64);
                let chunk = b[at..at + len].repeat(1 + rng.below(64));
                drop(b.splice(at..at, chunk));
            }
            // Very long lines, rarely: they cost the most time per case.
            8 if rng.below(16) == 0 => {
                let n = [1 << 10, 1 << 13, 1 << 16][rng.below(3)];
                let byte = *rng.pick(b"a0 :|-\t9Z");
                drop(b.splice(at..at, std::iter::repeat_n(byte, n)));
            }
            8 => drop(b.splice(at..at, token)),
            _ => b.truncate(at),
        }
    }
    b
}

/// Random bytes, mostly short: fully random, or drawn from the characters the line formats
/// use (so that some get past UTF-8 and the first checks).
pub fn random(rng: &mut Rng, max: usize) -> Vec<u8> {
    let cap = rng.below(max) + 1;
    let len = rng.below(cap);
    const ALPHABET: &[u8] = b"abcdeimnprstvzAGEPTZ0123456789:|-_.@/ \t\n\r#*`+";
    if rng.below(2) == 0 {
        (0..len).map(|_| rng.next() as u8).collect()
    } else {
        (0..len).map(|_| *rng.pick(ALPHABET)).collect()
    }
}

thread_local! {
    /// Set while a case runs on this thread: the panic hook records instead of printing.
    static CAUGHT: RefCell<Option<Option<String>>> = const { RefCell::new(None) };
}

fn install_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            let fuzzing = CAUGHT.with(|c| {
                let mut c = c.borrow_mut();
                match c.as_mut() {
                    Some(slot) => {
                        let mut at = info
                            .location()
                            .map_or("?".to_string(), |l| format!("{}:{}", l.file(), l.line()));
                        // In std or a dependency: the site is where our code called it.
                        if at.starts_with('/') {
                            at = format!("{at} (from {})", caller());
                        }
                        let msg = info
                            .payload()
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| info.payload().downcast_ref::<String>().cloned())
                            .unwrap_or_default();
                        *slot = Some(format!("{at}: {msg}"));
                        true
                    }
                    None => false,
                }
            });
            if !fuzzing {
                previous(info);
            }
        }));
    });
}

/// The innermost frame of this workspace's code (not this harness) on the stack.
fn caller() -> String {
    let trace = std::backtrace::Backtrace::force_capture().to_string();
    trace
        .lines()
        .filter_map(|l| l.trim().strip_prefix("at "))
        .find(|f| !f.starts_with('/') && f.contains(".rs:") && !f.contains("fuzz.rs"))
        .unwrap_or("?")
        .to_string()
}

fn env_u64(key: &str) -> Option<u64> {
    let v = std::env::var(key).ok()?;
    let v = v.trim();
    match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    }
}

/// Cases per parser: `AUTOMATON_FUZZ_ITERS`, else `default`.
pub fn iterations(default: u64) -> u64 {
    env_u64("AUTOMATON_FUZZ_ITERS").unwrap_or(default)
}

fn hex(bytes: &[u8]) -> String {
    const SHOWN: usize = 256;
    let mut s: String = bytes
        .iter()
        .take(SHOWN)
        .map(|b| format!("{b:02x}"))
        .collect();
    if bytes.len() > SHOWN {
        s.push_str(&format!("… ({} bytes)", bytes.len()));
    }
    s
}

/// Runs `cases` inputs through `check` (which returns whether the input parsed): one 1 MiB
/// random input, then alternately random bytes (0..4096) and mutations of `seeds`. Returns
/// one line per distinct panic site (file:line), with the first case that reached it.
pub fn run(
    name: &str,
    cases: u64,
    seeds: &[&str],
    words: &[&str],
    check: impl Fn(&[u8]) -> bool,
) -> Vec<String> {
    run_mix(name, cases, 2, seeds, words, check)
}

/// [`run`] with one case in `random_every` random, the others mutations.
pub fn run_mix(
    name: &str,
    cases: u64,
    random_every: u64,
    seeds: &[&str],
    words: &[&str],
    check: impl Fn(&[u8]) -> bool,
) -> Vec<String> {
    install_hook();
    let base = env_u64("AUTOMATON_FUZZ_SEED").unwrap_or(0x5EED_F022);
    let name_hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let mut sites: BTreeMap<String, (String, u64, Vec<u8>)> = BTreeMap::new();
    let mut parsed = 0u64;
    for i in 0..cases {
        let seed = Rng::new(base ^ name_hash).next().wrapping_add(i);
        let mut rng = Rng::new(seed);
        let input = match i {
            0 => (0..1 << 20).map(|_| rng.next() as u8).collect(),
            _ if i % random_every == 0 => random(&mut rng, 4096),
            _ => mutate(&mut rng, seeds, words),
        };
        CAUGHT.with(|c| *c.borrow_mut() = Some(None));
        let result = panic::catch_unwind(AssertUnwindSafe(|| check(&input)));
        let caught = CAUGHT.with(|c| c.borrow_mut().take()).flatten();
        match result {
            Ok(ok) => parsed += u64::from(ok),
            Err(_) => {
                let what = caught.unwrap_or_else(|| "?: panic".to_string());
                let site = what.split(": ").next().unwrap_or("?").to_string();
                sites.entry(site).or_insert((what, seed, input));
            }
        }
    }
    println!(
        "fuzz {name}: {cases} cases, {parsed} parsed, {} panic sites (base seed {base:#x})",
        sites.len()
    );
    sites
        .into_values()
        .map(|(what, seed, input)| {
            format!(
                "{name}: {what}\n    case seed {seed:#x}, input {:?}\n    hex {}",
                String::from_utf8_lossy(&input[..input.len().min(160)]),
                hex(&input)
            )
        })
        .collect()
}

/// Fails the test with every panic site of every target.
pub fn assert_no_panics(found: Vec<String>) {
    assert!(
        found.is_empty(),
        "{} panic site(s):\n{}",
        found.len(),
        found.join("\n")
    );
}
