//! What a phase measured: CPU time per side read from `/proc` (the worker, the servers, the
//! bench itself), throughput, memory, commit latency percentiles, and the machine they ran on.

use std::time::Duration;

use switchboard_tests::servers::{children_of, proc_kib};

/// `/proc` reports CPU times in USER_HZ ticks, which Linux fixes at 100 per second.
pub(crate) const USER_HZ: u64 = 100;

/// CPU ticks of `pid` (user + system), plus those of its reaped children when asked.
pub(crate) fn cpu_ticks(pid: u32, with_reaped_children: bool) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    let Some((_, after_name)) = stat.rsplit_once(')') else {
        return 0;
    };
    // Fields after the command name start at field 3 (state); utime is field 14.
    let fields: Vec<u64> = after_name
        .split_whitespace()
        .skip(11)
        .take(4)
        .map(|field| field.parse().unwrap_or(0))
        .collect();
    let own: u64 = fields.iter().take(2).sum();
    let reaped: u64 = fields.iter().skip(2).sum();
    if with_reaped_children {
        own + reaped
    } else {
        own
    }
}

/// CPU ticks of a server and everything it forked (PostgreSQL: postmaster and backends,
/// including backends that have exited since).
pub(crate) fn server_cpu_ticks(pid: u32) -> u64 {
    let children = i32::try_from(pid).map(children_of).unwrap_or_default();
    cpu_ticks(pid, true)
        + children
            .into_iter()
            .filter_map(|child| u32::try_from(child).ok())
            .map(|child| cpu_ticks(child, false))
            .sum::<u64>()
}

pub(crate) fn ticks_to_duration(ticks: u64) -> Duration {
    Duration::from_millis(ticks * 1000 / USER_HZ)
}

/// A line `Name: value kB` of `/proc/PID/status`, in KiB.
pub(crate) fn status_kib(pid: u32, name: &str) -> Option<u64> {
    proc_kib(pid, "status", name)
}

/// The memory of `pid` no other process maps (`Private_Clean` + `Private_Dirty` of
/// `/proc/PID/smaps_rollup`), in KiB: what one more worker of a binary already running costs.
pub(crate) fn private_kib(pid: u32) -> Option<u64> {
    Some(
        proc_kib(pid, "smaps_rollup", "Private_Clean")?
            + proc_kib(pid, "smaps_rollup", "Private_Dirty")?,
    )
}

/// CPU time spent, per side.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CpuSpent {
    /// The worker process, or the bench itself in the raw loops.
    pub(crate) client: Duration,
    pub(crate) postgres: Duration,
    pub(crate) redis: Duration,
    /// The server of the broker being measured beside Redis (ElasticMQ's JVM, …), the only
    /// broker server running.
    pub(crate) broker: Duration,
}

/// One line of the table.
#[derive(Debug, Clone)]
pub(crate) struct Measurement {
    pub(crate) name: String,
    pub(crate) messages: usize,
    pub(crate) elapsed: Duration,
    pub(crate) cpu: CpuSpent,
    pub(crate) peak_rss_kib: Option<u64>,
    /// The worker's batches into the store (worker phases only).
    pub(crate) store: Option<StoreUse>,
}

/// What a worker's metrics say of its batches over a phase.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StoreUse {
    /// The share of the wall time it spent in `ingest_batch` (over 100% with batches stored
    /// side by side).
    pub(crate) share: f64,
    /// Messages per batch, on average: a worker storing smaller batches than its reference
    /// pays PostgreSQL's cost per statement more often.
    pub(crate) mean_batch: f64,
}

impl Measurement {
    pub(crate) fn rate(&self) -> f64 {
        self.messages as f64 / self.elapsed.as_secs_f64()
    }

    pub(crate) fn micros_per_message(&self, spent: Duration) -> f64 {
        spent.as_secs_f64() * 1e6 / self.messages as f64
    }

    /// The CPU of every process of the phase (the client and every server, busy or idle), in
    /// µs per message.
    pub(crate) fn total_micros_per_message(&self) -> f64 {
        let CpuSpent {
            client,
            postgres,
            redis,
            broker,
        } = self.cpu;
        self.micros_per_message(client + postgres + redis + broker)
    }

    /// This raw database run and `after`, one run each side of the worker phase of `kind` at
    /// `batch_size`, as one row (`<kind>: raw DB …`): their messages, time and CPU added up.
    pub(crate) fn around(&self, after: &Measurement, kind: &str, batch_size: usize) -> Measurement {
        Measurement {
            name: format!("{kind}: {} batch {batch_size}", self.name),
            messages: self.messages + after.messages,
            elapsed: self.elapsed + after.elapsed,
            cpu: CpuSpent {
                client: self.cpu.client + after.cpu.client,
                postgres: self.cpu.postgres + after.cpu.postgres,
                redis: self.cpu.redis + after.cpu.redis,
                broker: self.cpu.broker + after.cpu.broker,
            },
            peak_rss_kib: None,
            store: None,
        }
    }
}

/// Commit latency percentiles of the steady-load run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Latency {
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) max_ms: f64,
}

/// CPU counters of both servers and of the bench process, read together.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CpuSnapshot {
    pub(crate) bench: u64,
    pub(crate) postgres: u64,
    pub(crate) redis: u64,
    pub(crate) broker: u64,
}

pub(crate) fn machine_summary() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|line| line.strip_prefix("model name")?.split_once(':'))
        .map(|(_, model)| model.trim().to_owned())
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let memory_gib = memory_total_kib().unwrap_or(0) as f64 / 1024.0 / 1024.0;
    format!("{cpus} CPUs ({model}), {memory_gib:.1} GiB RAM")
}

pub(crate) fn memory_total_kib() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
}

pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|load| {
            load.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}
