//! GPUs behind one trait: NVML on a real machine, `--simulate-gpu NAME:SIZE` fakes in tests
//! and on machines without an accelerator. Neither fails the probe: no library or no device
//! is an empty list and a one-line reason.

use super::{Gpu, ProbeError};

pub const GIB: u64 = 1 << 30;

/// Where GPUs come from.
pub trait GpuSource {
    /// The GPUs, or why there are none (one line).
    fn gpus(&self) -> Result<Vec<Gpu>, String>;
    /// How the report names this source: `NVML`, `simulated`.
    fn label(&self) -> &'static str;
}

/// The real thing: `libnvidia-ml.so.1`, loaded at run time.
pub struct NvmlSource;

impl GpuSource for NvmlSource {
    fn gpus(&self) -> Result<Vec<Gpu>, String> {
        let nvml = nvml_wrapper::Nvml::init().map_err(|e| {
            format!("no NVIDIA library: NVML could not load libnvidia-ml.so.1 ({e})")
        })?;
        let driver = nvml
            .sys_driver_version()
            .unwrap_or_else(|e| format!("unknown ({e})"));
        let count = nvml
            .device_count()
            .map_err(|e| format!("NVML could not count devices ({e})"))?;
        if count == 0 {
            return Err("NVML loaded but found no GPU".into());
        }
        let mut out = Vec::new();
        let mut skipped = Vec::new();
        for index in 0..count {
            // One broken device must not hide the others.
            let dev = match nvml.device_by_index(index) {
                Ok(d) => d,
                Err(e) => {
                    skipped.push(format!("GPU {index}: {e}"));
                    continue;
                }
            };
            let mem = match dev.memory_info() {
                Ok(m) => m,
                Err(e) => {
                    skipped.push(format!("GPU {index} memory: {e}"));
                    continue;
                }
            };
            out.push(Gpu {
                index,
                name: dev.name().unwrap_or_else(|_| "unknown".into()),
                uuid: dev.uuid().unwrap_or_else(|_| format!("GPU-{index}")),
                total_bytes: mem.total,
                free_bytes: mem.free,
                driver: driver.clone(),
            });
        }
        if out.is_empty() {
            return Err(format!("NVML found no usable GPU ({})", skipped.join("; ")));
        }
        Ok(out)
    }

    fn label(&self) -> &'static str {
        "NVML"
    }
}

/// `--simulate-gpu` fakes: free = total, uuid `SIM-<name>`.
pub struct Simulated(pub Vec<(String, u64)>);

impl GpuSource for Simulated {
    fn gpus(&self) -> Result<Vec<Gpu>, String> {
        Ok(self
            .0
            .iter()
            .enumerate()
            .map(|(i, (name, bytes))| Gpu {
                index: u32::try_from(i).unwrap_or(u32::MAX),
                name: name.clone(),
                uuid: format!("SIM-{name}"),
                total_bytes: *bytes,
                free_bytes: *bytes,
                driver: "simulated".into(),
            })
            .collect())
    }

    fn label(&self) -> &'static str {
        "simulated"
    }
}

/// `NAME:SIZE` with SIZE like `24GiB`, `24GB`, `8192MiB`, `500MB` (decimal fractions ok).
pub fn parse_simulated(s: &str) -> Result<(String, u64), ProbeError> {
    let bad = || ProbeError::SimulatedGpu(s.to_string());
    let (name, size) = s.rsplit_once(':').ok_or_else(bad)?;
    let name = name.trim();
    if name.is_empty() || name.contains(char::is_whitespace) {
        return Err(bad());
    }
    let bytes = parse_size(size.trim()).ok_or_else(bad)?;
    if bytes == 0 {
        return Err(bad());
    }
    Ok((name.to_string(), bytes))
}

/// `24GiB`, `24GB`, `8192MiB`, `500MB` → bytes.
pub fn parse_size(s: &str) -> Option<u64> {
    let lower = s.to_ascii_lowercase();
    let (num, unit) = [
        ("gib", GIB as f64),
        ("gb", 1e9),
        ("mib", (1u64 << 20) as f64),
        ("mb", 1e6),
    ]
    .into_iter()
    .find_map(|(suffix, mult)| {
        lower
            .strip_suffix(suffix)
            .map(|n| (n.trim().to_string(), mult))
    })?;
    let n: f64 = num.parse().ok()?;
    (n.is_finite() && n > 0.0).then_some((n * unit) as u64)
}

/// clap's check for `--simulate-gpu`: the value stays a string (the session forwards it).
pub fn validate_simulated(s: &str) -> Result<String, String> {
    parse_simulated(s)
        .map(|_| s.to_string())
        .map_err(|e| e.to_string())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn simulated_sizes_accept_gib_gb_mib_mb_and_reject_garbage() {
        assert_eq!(
            parse_simulated("sim-a:24GiB").unwrap(),
            ("sim-a".into(), 24 * GIB)
        );
        assert_eq!(parse_simulated("b:80GB").unwrap().1, 80_000_000_000);
        assert_eq!(parse_simulated("c:8192MiB").unwrap().1, 8 * GIB);
        assert_eq!(parse_simulated("d:500MB").unwrap().1, 500_000_000);
        for bad in [
            "sim-a",
            "sim-a:24",
            "sim-a:lots",
            ":24GiB",
            "a:0GiB",
            "a:-1GiB",
            "a:24TB",
        ] {
            let e = parse_simulated(bad).unwrap_err().to_string();
            assert!(e.contains("NAME:SIZE"), "{bad}: {e}");
            assert!(!e.contains('\n'));
        }
    }

    #[test]
    fn simulated_gpus_have_free_equal_total_and_sim_uuid() {
        let g = Simulated(vec![("x".into(), 24 * GIB)]).gpus().unwrap();
        assert_eq!(g[0].uuid, "SIM-x");
        assert_eq!(g[0].free_bytes, g[0].total_bytes);
    }
}
