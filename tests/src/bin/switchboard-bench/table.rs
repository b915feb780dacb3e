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

    /// This row's rate over the slower of `a` and `b`, per round.
    pub(crate) fn ratio_to_slower(&self, a: &Row, b: &Row) -> Stat {
        Stat::of(
            self.runs
                .iter()
                .zip(a.runs.iter().zip(&b.runs))
                .map(|(m, (a, b))| m.rate() / a.rate().min(b.rate()))
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
        "| {:<44} | {:>8} | {:>7} | {:>23} | {:>17} | {:>20} | {:>14} | {:>16} | {:>8} | {:>8} |",
        "phase",
        "messages",
        "seconds",
        "msg/s (min–max)",
        "client µs/msg",
        "postgres µs/msg",
        "redis µs/msg",
        "broker µs/msg",
        "peak RSS",
        "in store"
    );
    println!(
        "|{:-<46}|{:->10}|{:->9}|{:->25}|{:->19}|{:->22}|{:->16}|{:->18}|{:->10}|{:->10}|",
        "", "", "", "", "", "", "", "", "", ""
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
        let store_share = if row.runs.iter().all(|m| m.store_share.is_some()) {
            format!(
                "{:.0}%",
                row.stat(|m| m.store_share.unwrap_or(0.0)).median * 100.0
            )
        } else {
            "-".to_owned()
        };
        println!(
            "| {:<44} | {:>8} | {:>7.2} | {:>23} | {:>17} | {:>20} | {:>14} | {:>16} | {:>8} | {:>8} |",
            row.name(),
            row.runs[0].messages,
            row.stat(|m| m.elapsed.as_secs_f64()).median,
            row.rate().show(0, 1.0),
            per_message(|cpu| cpu.client),
            per_message(|cpu| cpu.postgres),
            per_message(|cpu| cpu.redis),
            per_message(|cpu| cpu.broker),
            rss,
            store_share
        );
    }
}

pub(crate) fn verdict(passed: bool) -> &'static str {
    if passed { "PASS" } else { "FAIL" }
}
