//! The bench's table: every figure's median and spread over the repetitions, with the ratios
//! and verdicts.

use std::time::Duration;

use anyhow::{Context as _, Result};

use crate::measure::{CpuSpent, Measurement};

/// The median and the spread of one figure over the repetitions.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stat {
    pub(crate) median: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
}

impl Stat {
    pub(crate) fn of(mut values: Vec<f64>) -> Self {
        values.sort_by(f64::total_cmp);
        let n = values.len();
        let median = match n {
            0 => f64::NAN,
            _ if n % 2 == 1 => values[n / 2],
            _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
        };
        Self {
            median,
            min: values.first().copied().unwrap_or(f64::NAN),
            max: values.last().copied().unwrap_or(f64::NAN),
        }
    }

    /// `median (min–max)` with `decimals` decimals, scaled by `scale` (e.g. 100 for percent).
    pub(crate) fn show(self, decimals: usize, scale: f64) -> String {
        format!(
            "{:.decimals$} ({:.decimals$}–{:.decimals$})",
            self.median * scale,
            self.min * scale,
            self.max * scale
        )
    }
}

/// Every repetition of one phase.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) runs: Vec<Measurement>,
}

impl Row {
    pub(crate) fn name(&self) -> &str {
        &self.runs[0].name
    }

    pub(crate) fn stat(&self, figure: impl Fn(&Measurement) -> f64) -> Stat {
        Stat::of(self.runs.iter().map(figure).collect())
    }

    pub(crate) fn rate(&self) -> Stat {
        self.stat(Measurement::rate)
    }

    /// `figure` of this row's run and `a`'s and `b`'s of the same round, per round.
    fn per_round(
        &self,
        a: &Row,
        b: &Row,
        figure: impl Fn(&Measurement, &Measurement, &Measurement) -> f64,
    ) -> Stat {
        Stat::of(
            self.runs
                .iter()
                .zip(a.runs.iter().zip(&b.runs))
                .map(|(m, (a, b))| figure(m, a, b))
                .collect(),
        )
    }

    /// This row's rate over the slower of `a` and `b`, per round.
    pub(crate) fn ratio_to_slower(&self, a: &Row, b: &Row) -> Stat {
        self.per_round(a, b, |m, a, b| m.rate() / a.rate().min(b.rate()))
    }

    /// The CPU per message of the raw broker loop and the raw database path together, over
    /// this worker row's, per round: 100% when the worker costs no CPU beyond receiving,
    /// acknowledging and storing the messages as the raw loops do. Noise and cores shared
    /// between the processes barely move it, unlike a ratio of rates.
    pub(crate) fn cpu_efficiency(&self, raw: &Row, raw_db: &Row) -> Stat {
        self.per_round(raw, raw_db, |m, raw, raw_db| {
            (raw.total_micros_per_message() + raw_db.total_micros_per_message())
                / m.total_micros_per_message()
        })
    }

    /// This row's rate over the shared-CPU ceiling `1 / (1/raw + 1/raw_db)`, per round: the
    /// rate of the two raw paths run one after the other on the same cores, which is what the
    /// worker does (a worker costing nothing of its own reaches 100%).
    pub(crate) fn share_of_ceiling(&self, raw: &Row, raw_db: &Row) -> Stat {
        self.per_round(raw, raw_db, |m, raw, raw_db| {
            m.rate() * (1.0 / raw.rate() + 1.0 / raw_db.rate())
        })
    }

    /// PostgreSQL's CPU per message in this row over `other`'s, per round.
    pub(crate) fn postgres_ratio_to(&self, other: &Row) -> Stat {
        Stat::of(
            self.runs
                .iter()
                .zip(&other.runs)
                .map(|(a, b)| {
                    a.micros_per_message(a.cpu.postgres) / b.micros_per_message(b.cpu.postgres)
                })
                .collect(),
        )
    }

    /// This row's rate over `other`'s, per round (the same round ran both).
    pub(crate) fn ratio_to(&self, other: &Row) -> Stat {
        Stat::of(
            self.runs
                .iter()
                .zip(&other.runs)
                .map(|(a, b)| a.rate() / b.rate())
                .collect(),
        )
    }
}

/// The rows in the order the first round ran them.
#[derive(Debug, Default)]
pub(crate) struct Table {
    pub(crate) rows: Vec<Row>,
}

impl Table {
    pub(crate) fn add(&mut self, measurement: Measurement) {
        eprintln!(
            "{}: {:.0} msg/s ({:.2} s)",
            measurement.name,
            measurement.rate(),
            measurement.elapsed.as_secs_f64()
        );
        match self
            .rows
            .iter_mut()
            .find(|row| row.name() == measurement.name)
        {
            Some(row) => row.runs.push(measurement),
            None => self.rows.push(Row {
                runs: vec![measurement],
            }),
        }
    }

    pub(crate) fn row(&self, name: &str) -> Result<&Row> {
        self.rows
            .iter()
            .find(|row| row.name() == name)
            .with_context(|| format!("no phase {name:?} was measured"))
    }

    /// The raw database limit measured around the worker phase of `kind`.
    pub(crate) fn raw_db_around(&self, kind: &str) -> Result<&Row> {
        let prefix = format!("{kind}: raw DB ");
        self.rows
            .iter()
            .find(|row| row.name().starts_with(&prefix))
            .with_context(|| format!("no raw database run around the {kind} worker"))
    }

    /// The row with the best median rate among those whose name starts with `prefix`.
    pub(crate) fn best(&self, prefix: &str) -> Option<&Row> {
        self.rows
            .iter()
            .filter(|row| row.name().starts_with(prefix))
            .max_by(|a, b| a.rate().median.total_cmp(&b.rate().median))
    }
}

pub(crate) fn print_table(table: &Table) {
    println!(
        "| {:<44} | {:>8} | {:>7} | {:>23} | {:>17} | {:>20} | {:>14} | {:>16} | {:>8} | {:>8} | {:>5} |",
        "phase",
        "messages",
        "seconds",
        "msg/s (min–max)",
        "client µs/msg",
        "postgres µs/msg",
        "redis µs/msg",
        "broker µs/msg",
        "peak RSS",
        "in store",
        "batch"
    );
    println!(
        "|{:-<46}|{:->10}|{:->9}|{:->25}|{:->19}|{:->22}|{:->16}|{:->18}|{:->10}|{:->10}|{:->7}|",
        "", "", "", "", "", "", "", "", "", "", ""
    );
    for row in &table.rows {
        let per_message = |side: fn(&CpuSpent) -> Duration| {
            row.stat(|m| m.micros_per_message(side(&m.cpu)))
                .show(1, 1.0)
        };
        let rss = if row.runs.iter().all(|m| m.peak_rss_kib.is_some()) {
            format!(
                "{:.1} MiB",
                row.stat(|m| m.peak_rss_kib.unwrap_or(0) as f64).median / 1024.0
            )
        } else {
            "-".to_owned()
        };
        let (store_share, mean_batch) = if row.runs.iter().all(|m| m.store.is_some()) {
            let store = |m: &Measurement| m.store.map_or(0.0, |store| store.share);
            let batch = |m: &Measurement| m.store.map_or(0.0, |store| store.mean_batch);
            (
                format!("{:.0}%", row.stat(store).median * 100.0),
                format!("{:.0}", row.stat(batch).median),
            )
        } else {
            ("-".to_owned(), "-".to_owned())
        };
        println!(
            "| {:<44} | {:>8} | {:>7.2} | {:>23} | {:>17} | {:>20} | {:>14} | {:>16} | {:>8} | {:>8} | {:>5} |",
            row.name(),
            row.runs[0].messages,
            row.stat(|m| m.elapsed.as_secs_f64()).median,
            row.rate().show(0, 1.0),
            per_message(|cpu| cpu.client),
            per_message(|cpu| cpu.postgres),
            per_message(|cpu| cpu.redis),
            per_message(|cpu| cpu.broker),
            rss,
            store_share,
            mean_batch
        );
    }
}

/// CPU efficiency ≥ this is a pass (see [`Row::cpu_efficiency`]).
const CPU_EFFICIENCY_TARGET: f64 = 0.9;
/// A share of the shared-CPU ceiling ≥ this is a pass (see [`Row::share_of_ceiling`]).
const CEILING_TARGET: f64 = 0.85;

/// The verdict lines of one broker's worker (`name`) against its raw loop and the raw database
/// path measured around it: CPU efficiency and the share of the shared-CPU ceiling, each
/// against its target, or shown without one when `targets` is false.
pub(crate) fn print_efficiency(name: &str, worker: &Row, raw: &Row, raw_db: &Row, targets: bool) {
    let lines = [
        (
            "CPU efficiency (raw loop + raw DB µs/msg) / worker µs/msg",
            worker.cpu_efficiency(raw, raw_db),
            CPU_EFFICIENCY_TARGET,
        ),
        (
            "msg/s / shared-CPU ceiling 1/(1/raw loop + 1/raw DB)",
            worker.share_of_ceiling(raw, raw_db),
            CEILING_TARGET,
        ),
    ];
    for (what, stat, target) in lines {
        let judged = if targets {
            format!(
                "target >= {:.0}%    {}",
                target * 100.0,
                verdict(stat.median >= target)
            )
        } else {
            "no target".to_owned()
        };
        println!("{name} {what}: {:>20}%  {judged}", stat.show(1, 100.0));
    }
}

pub(crate) fn verdict(passed: bool) -> &'static str {
    if passed { "PASS" } else { "FAIL" }
}
