//! The operator's per-adapter gauges against a real etcd + kube-apiserver (no kubelet: the test
//! plays the Deployment controller): `switchboard_operator_adapter_workers{state}` follows the
//! worker Deployment and `switchboard_operator_adapter_ready` the Ready condition, so that alerts
//! fire for workers that never start (no worker series at all); the series go with the adapter.

use std::cell::Cell;

use anyhow::Result;
use kube::api::DeleteParams;
use switchboard_tests::control_plane::{
    OPERATOR_TIMEOUT, OperatorEnv, OperatorProcess, adapter_manifest,
};
use switchboard_tests::wait::wait_for;

const ADAPTER: &str = "shop/orders";

/// The operator's series of adapter `shop/orders`: (ready, desired workers, available workers),
/// each `None` when not exported.
async fn gauges(operator: &OperatorProcess) -> Result<[Option<f64>; 3]> {
    let (_, body) = operator.http_get("/metrics").await?;
    let value = |series: String| {
        body.lines()
            .find_map(|line| line.strip_prefix(series.as_str())?.strip_prefix(' '))
            .and_then(|value| value.parse().ok())
    };
    Ok([
        value(format!(
            r#"switchboard_operator_adapter_ready{{adapter="{ADAPTER}"}}"#
        )),
        value(format!(
            r#"switchboard_operator_adapter_workers{{adapter="{ADAPTER}",state="desired"}}"#
        )),
        value(format!(
            r#"switchboard_operator_adapter_workers{{adapter="{ADAPTER}",state="available"}}"#
        )),
    ])
}

/// Waits until the gauges are `expected`.
async fn wait_gauges(
    operator: &OperatorProcess,
    what: &str,
    expected: [Option<f64>; 3],
) -> Result<()> {
    let seen = &Cell::new([None; 3]);
    wait_for(OPERATOR_TIMEOUT, what, || async move {
        seen.set(gauges(operator).await?);
        Ok(seen.get() == expected)
    })
    .await
    .map_err(|err| {
        err.context(format!(
            "(ready, desired, available) = {:?}, expected {expected:?}\n{}",
            seen.get(),
            operator.log_tail()
        ))
    })
}

#[tokio::test]
async fn operator_adapter_gauges_follow_the_deployment_and_the_ready_condition() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let operator = env.start_operator("operator-a", &[])?;
    env.apply_adapter(&adapter_manifest("orders", "  workload: {replicas: 2}\n"))
        .await?;
    // Applied, and no pod ever starts (as with ImagePullBackOff): two wanted, none available,
    // not ready, while no worker exports anything.
    wait_gauges(
        &operator,
        "2 workers desired, 0 available, not ready",
        [Some(0.0), Some(2.0), Some(0.0)],
    )
    .await?;

    env.mark_deployment_available("orders-worker").await?;
    wait_gauges(
        &operator,
        "2 workers available, ready",
        [Some(1.0), Some(2.0), Some(2.0)],
    )
    .await?;

    // Blocked (an invalid spec: no Redis Secret named): not ready, and the workers unknown
    // rather than stale.
    env.apply_adapter(
        &adapter_manifest("orders", "  workload: {replicas: 2}\n")
            .replace(", urlSecretRef: {name: redis, key: url}", ""),
    )
    .await?;
    wait_gauges(
        &operator,
        "blocked: not ready, no worker series",
        [Some(0.0), None, None],
    )
    .await?;

    env.adapters()
        .delete("orders", &DeleteParams::default())
        .await?;
    wait_gauges(&operator, "the adapter's series removed", [None; 3]).await?;
    let (_, body) = operator.http_get("/metrics").await?;
    anyhow::ensure!(!body.contains(ADAPTER), "series of {ADAPTER} left:\n{body}");
    Ok(())
}
