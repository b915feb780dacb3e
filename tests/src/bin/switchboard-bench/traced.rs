//! The cost of trace context (issue 33): the worker draining `--trace-messages` stream entries
//! that each carry a W3C `traceparent` and `tracestate`, with span export off and on (to a real
//! OpenTelemetry Collector), against the same entries whose two fields have other names (the
//! same bytes, no trace context). Per round, the three runs one after the other; the verdicts
//! are per-round ratios of msg/s (export off against none: the cost of reading and keeping the
//! context; export on against off: the cost of the spans), the worker's CPU per message beside
//! them.

use anyhow::{Context, Result};
use switchboard_tests::Fixture;
use switchboard_tests::otel::Collector;

use crate::table::{Table, verdict};
use crate::{Bench, Drain, Mode, order_body};

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct TraceArgs {
    /// Messages of each trace-context run (0: none).
    #[arg(long, default_value_t = 50_000)]
    pub(crate) trace_messages: usize,
}

const UNTRACED: &str = "worker stream, same fields, no trace context";
const EXPORT_OFF: &str = "worker stream, traceparent, export off";
const EXPORT_ON: &str = "worker stream, traceparent, export on";

/// XADDs `entries` order bodies to `key`, each with a `traceparent` (its own span id) and a
/// `tracestate` field — or, not `traced`, the same two values under other names.
fn preload(fx: &Fixture, key: &str, entries: usize, traced: bool) -> Result<()> {
    let (parent, state) = if traced {
        ("traceparent", "tracestate")
    } else {
        ("x-parent-id", "x-statelist")
    };
    let mut conn = fx.redis.connection()?;
    for chunk in (0..entries).collect::<Vec<_>>().chunks(1000) {
        let mut pipe = redis::pipe();
        for &i in chunk {
            let traceparent = format!("00-4bf92f3577b34da6a3ce929d0e0e4736-{:016x}-01", i + 1);
            pipe.cmd("XADD")
                .arg(key)
                .arg("*")
                .arg("body")
                .arg(order_body(i))
                .arg(parent)
                .arg(traceparent)
                .arg(state)
                .arg("congo=t61rcWkgMzE")
                .ignore();
        }
        pipe.query::<()>(&mut conn)?;
    }
    Ok(())
}

impl Bench {
    /// The three trace-context runs of one round; `collector` receives the exported spans.
    pub(crate) async fn trace_rounds(
        &mut self,
        collector: &Collector,
        table: &mut Table,
    ) -> Result<()> {
        let entries = self.args.traced.trace_messages;
        let batch_size = self.args.batch_size;
        let endpoint = collector.http_endpoint();
        let export = [("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str())];
        for (label, traced, env) in [
            (UNTRACED, false, &[][..]),
            (EXPORT_OFF, true, &[][..]),
            (EXPORT_ON, true, &export[..]),
        ] {
            let slug = label.rsplit(", ").next().unwrap_or(label).replace(' ', "-");
            let drain = Drain {
                mode: Mode::Stream,
                name: format!("traced-{slug}-r{}", self.round),
                label: label.to_owned(),
                batch_size,
                entries,
            };
            let load = |fx: &Fixture, key: &str| preload(fx, key, entries, traced);
            table.add(self.drain(drain, load, env).await?);
        }
        Ok(())
    }
}

/// The verdicts, per round: export off against no trace context (target at least 95%: reading
/// and keeping the context costs next to nothing) and export on against export off (target at
/// least 95%: the spans), with the worker's CPU per message of each.
pub(crate) fn print_verdicts(table: &Table) -> Result<()> {
    let untraced = table.row(UNTRACED).context("no untraced run")?;
    let off = table.row(EXPORT_OFF)?;
    let on = table.row(EXPORT_ON)?;
    let cpu = |row: &crate::table::Row| row.stat(|m| m.micros_per_message(m.cpu.client));
    for (what, row, base) in [
        ("export off / no context", off, untraced),
        ("export on / export off ", on, off),
    ] {
        let ratio = row.ratio_to(base);
        println!(
            "traceparent, {what} (msg/s): {:>16}%  target >= 95%    {}  \
             (worker {} vs {} µs/msg)",
            ratio.show(1, 100.0),
            verdict(ratio.median >= 0.95),
            cpu(row).show(2, 1.0),
            cpu(base).show(2, 1.0),
        );
    }
    Ok(())
}
