//! What every service serves from its start (`/metrics` and the OTLP export): its build
//! (`forkfleet_build_info{version, service}`), the process metrics the Prometheus client
//! libraries serve (`process_cpu_seconds_total`, `process_resident_memory_bytes`,
//! `process_start_time_seconds`, `process_open_fds`, `process_threads`; read from `/proc`
//! each time the registry is read), and the counters that must exist before their first
//! increment, at zero, so that `rate()` and `increase()` see it.

use crate::telemetry::Service;
use forkfleet_shared::metrics::{catalog, register_collector, CollectorGuard};
use forkfleet_shared::state::BranchState;

/// Set the build info and the counters at zero, and read the process's figures whenever
/// the registry is read, until the guard drops.
pub fn install(service: Service, service_name: &str) -> CollectorGuard {
    catalog::BUILD_INFO.set(&[env!("CARGO_PKG_VERSION"), service_name], 1.0);
    catalog::BUS_RECONNECTS.touch(&[]);
    if service == Service::Coordinator {
        catalog::EVENTS_APPLIED.touch(&[]);
        for state in BranchState::ALL.iter().filter(|s| s.is_terminal()) {
            catalog::BRANCHES_ENDED.touch(&[state.as_str()]);
        }
        for scope in ["branch", "fork", "account"] {
            catalog::BUDGET_REFUSALS.touch(&[scope]);
        }
    }
    let start = start_time_s();
    if let Some(t) = start {
        catalog::PROCESS_START_TIME.set(&[], t);
    }
    register_collector(read_proc)
}

/// The figures of `/proc/self` (nothing where it cannot be read).
fn read_proc() {
    if let Some(stat) = stat_fields() {
        let tick = clock_tick();
        let field = |n: usize| stat.get(n).and_then(|v| v.parse::<f64>().ok());
        if let (Some(user), Some(system)) = (field(UTIME), field(STIME)) {
            catalog::PROCESS_CPU.advance_to(&[], (user + system) / tick);
        }
        if let Some(threads) = field(THREADS) {
            catalog::PROCESS_THREADS.set(&[], threads);
        }
    }
    if let Some(pages) = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<f64>().ok())
    {
        catalog::PROCESS_RESIDENT_MEMORY.set(&[], pages * page_size());
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        // The directory being read is one of them.
        let open = fds.count().saturating_sub(1);
        catalog::PROCESS_OPEN_FDS.set(&[], open as f64);
    }
}

/// Positions in [`stat_fields`] of `utime`, `stime`, `num_threads` and `starttime`
/// (fields 14, 15, 20 and 22 of proc(5), counted from the state, field 3).
const UTIME: usize = 11;
const STIME: usize = 12;
const THREADS: usize = 17;
const STARTTIME: usize = 19;

/// The fields of `/proc/self/stat` after the command name (which may hold spaces and
/// parentheses: everything to its last `)`).
fn stat_fields() -> Option<Vec<String>> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    Some(rest.split_whitespace().map(str::to_string).collect())
}

fn clock_tick() -> f64 {
    // SAFETY: sysconf only reads a configuration value.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

fn page_size() -> f64 {
    // SAFETY: as above.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as f64
    } else {
        4096.0
    }
}

/// When the process started, in seconds since the epoch: the boot time (`btime` of
/// `/proc/stat`) plus the process's start in clock ticks after boot.
fn start_time_s() -> Option<f64> {
    let ticks: f64 = stat_fields()?.get(STARTTIME)?.parse().ok()?;
    let boot: f64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    Some(boot + ticks / clock_tick())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_process_figures_are_read_from_proc() {
        let _guard = install(Service::Worker, "forkfleet-worker-test");
        let text = forkfleet_shared::metrics::render_prometheus();
        for name in [
            "process_cpu_seconds_total ",
            "process_resident_memory_bytes ",
            "process_start_time_seconds ",
            "process_open_fds ",
            "process_threads ",
            "forkfleet_bus_reconnects_total 0",
        ] {
            assert!(text.contains(name), "{name} in\n{text}");
        }
        assert!(
            text.contains(&format!(
                "forkfleet_build_info{{version=\"{}\",service=\"forkfleet-worker-test\"}} 1",
                env!("CARGO_PKG_VERSION")
            )),
            "{text}"
        );
        let rss = catalog::PROCESS_RESIDENT_MEMORY.get(&[]).unwrap();
        assert!(rss > 1e6, "{rss}");
        let start = catalog::PROCESS_START_TIME.get(&[]).unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(start <= now + 1.0 && start > now - 3600.0, "{start} {now}");
    }
}
