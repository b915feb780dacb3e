//! The cost of trace context (issue 33): the worker draining `--trace-messages` stream entries
//! that each carry a W3C `traceparent` and `tracestate`, with span export off and on (to a real
//! OpenTelemetry Collector), against the same number of entries without trace context. Per
//! round, the three runs one after the other; the verdicts are per-round ratios of msg/s and the
//! worker's CPU per message beside them.

use anyhow::{Context, Result};
use switchboard_tests::Fixture;
use switchboard_tests::otel::Collector;

use crate::table::{Table, verdict};
use crate::{Bench, Drain, Mode, order_body};

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct TraceArgs {
    /// Messages of each trace-context run (0: none).
    #[arg(long, default_value_t = 10_000)]
    pub(crate) trace_messages: usize,
}

const UNTRACED: &str = "worker stream, no trace context";
const EXPORT_OFF: &str = "worker stream, traceparent, export off";
const EXPORT_ON: &str = "worker stream, traceparent, export on";

/// XADDs `entries` order bodies to `key`, each with a `traceparent` (its own span id) and a
/// `tracestate` field.
fn preload_traced(fx: &Fixture, key: &str, entries: usize) -> Result<()> {
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
                .arg("traceparent")
                .arg(traceparent)
                .arg("tracestate")
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
            let preload = |fx: &Fixture, key: &str| {
                if traced {
                    preload_traced(fx, key, entries)
                } else {
                    Mode::Stream.preload(fx, key, (0..entries).map(order_body))
                }
            };
            table.add(self.drain(drain, preload, env).await?);
        }
        Ok(())
    }
}

/// The verdicts: export on and export off against no trace context, msg/s per round (target
/// at least 95%), and the worker's CPU per message of each.
pub(crate) fn print_verdicts(table: &Table) -> Result<()> {
    let untraced = table.row(UNTRACED).context("no untraced run")?;
    for (label, what) in [(EXPORT_OFF, "export off"), (EXPORT_ON, "export on")] {
        let row = table.row(label)?;
        let ratio = row.ratio_to(untraced);
        let cpu = row.stat(|m| m.micros_per_message(m.cpu.client));
        let base = untraced.stat(|m| m.micros_per_message(m.cpu.client));
        println!(
            "traceparent, {what:<10} / none (msg/s): {:>16}%  target >= 95%    {}  \
             (worker {} vs {} µs/msg)",
            ratio.show(1, 100.0),
            verdict(ratio.median >= 0.95),
            cpu.show(2, 1.0),
            base.show(2, 1.0),
        );
    }
    Ok(())
}
