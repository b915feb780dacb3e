//! Two operator processes with leader election against a real kube-apiserver: only the Lease
//! holder reconciles; the standby takes over when the leader stops (released lease) or dies
//! (expired lease).

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use switchboard_tests::control_plane::{
    OPERATOR_TIMEOUT, OperatorEnv, OperatorProcess, adapter_manifest,
};
use switchboard_tests::wait::wait_for;

const LEADER_ARGS: &[&str] = &[
    "--leader-election",
    "--lease-namespace",
    "shop",
    "--lease-duration",
    "3s",
];

async fn holder(env: &OperatorEnv) -> Result<Option<String>> {
    let leases: Api<Lease> = Api::namespaced(env.admin.clone(), OperatorEnv::NAMESPACE);
    Ok(leases
        .get_opt("switchboard-operator")
        .await?
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity))
}

/// Whether the Lease is held by the replica with host name `host` (identity `host_<suffix>`).
async fn held_by(env: &OperatorEnv, host: &str) -> Result<bool> {
    Ok(holder(env)
        .await?
        .and_then(|h| h.strip_prefix(host).map(|rest| rest.starts_with('_')))
        .unwrap_or(false))
}

async fn wait_leader(operator: &OperatorProcess) -> Result<()> {
    wait_for(
        OPERATOR_TIMEOUT,
        &format!("{} leads", operator.identity),
        || async { Ok(operator.metric_sum("switchboard_operator_leader").await? == 1.0) },
    )
    .await
    .with_context(|| operator.log_tail())
}

async fn reconciliations(operator: &OperatorProcess) -> Result<f64> {
    operator
        .metric_sum("switchboard_operator_reconciliations_total")
        .await
}

async fn wait_reconciled(operator: &OperatorProcess) -> Result<()> {
    wait_for(
        OPERATOR_TIMEOUT,
        &format!("{} counts reconciliations", operator.identity),
        || async { Ok(reconciliations(operator).await? > 0.0) },
    )
    .await
}

/// Starts `operator-a` (leader) and `operator-b` (standby) and proves only A reconciles.
async fn leader_and_standby(env: &OperatorEnv) -> Result<(OperatorProcess, OperatorProcess)> {
    let a = env.start_operator("operator-a", LEADER_ARGS)?;
    wait_leader(&a).await?;
    let b = env.start_operator("operator-b", LEADER_ARGS)?;
    wait_for(OPERATOR_TIMEOUT, "the standby is ready", || async {
        Ok(b.http_get("/readyz").await?.0 == 200)
    })
    .await
    .with_context(|| b.log_tail())?;
    env.apply_adapter(&adapter_manifest("first", "")).await?;
    env.wait_deployment("first-worker", "the leader creates the worker", |_| true)
        .await?;
    ensure!(held_by(env, "operator-a").await?);
    wait_reconciled(&a).await?;
    ensure!(reconciliations(&b).await? == 0.0, "the standby reconciled");
    ensure!(b.metric_sum("switchboard_operator_leader").await? == 0.0);
    ensure!(b.log().contains("another replica leads; standing by"));
    Ok((a, b))
}

async fn standby_takes_over(env: &OperatorEnv, b: &OperatorProcess) -> Result<()> {
    wait_leader(b).await?;
    env.apply_adapter(&adapter_manifest("second", "")).await?;
    env.wait_deployment("second-worker", "the new leader creates the worker", |_| {
        true
    })
    .await?;
    ensure!(held_by(env, "operator-b").await?);
    wait_reconciled(b).await?;
    Ok(())
}

#[tokio::test]
async fn only_the_lease_holder_reconciles_and_the_standby_takes_over_when_it_stops() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let (mut a, b) = leader_and_standby(&env).await?;
    a.terminate(std::time::Duration::from_secs(30))?;
    ensure!(
        a.log().contains("released the leader lease"),
        "{}",
        a.log_tail()
    );
    standby_takes_over(&env, &b).await
}

#[tokio::test]
async fn a_killed_leader_is_replaced_once_its_lease_expires() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let (a, b) = leader_and_standby(&env).await?;
    drop(a); // SIGKILL: no release, the lease must expire.
    standby_takes_over(&env, &b).await
}

#[tokio::test]
async fn two_replicas_with_the_same_host_name_elect_exactly_one_leader() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let a = env.start_operator("operator", LEADER_ARGS)?;
    wait_leader(&a).await?;
    // Same HOSTNAME, its own log file.
    let b_logs = env.fixture.dir.path().join("second");
    std::fs::create_dir_all(&b_logs)?;
    let b = OperatorProcess::start(
        &env.plane.operator_kubeconfig,
        &env.fixture.postgres.url(),
        &b_logs,
        "operator",
        LEADER_ARGS,
    )?;
    wait_for(
        OPERATOR_TIMEOUT,
        "the second replica leads or stands by",
        || async {
            Ok(b.metric_sum("switchboard_operator_leader").await? == 1.0
                || b.log().contains("another replica leads; standing by"))
        },
    )
    .await
    .with_context(|| b.log_tail())?;
    ensure!(
        b.metric_sum("switchboard_operator_leader").await? == 0.0,
        "both replicas lead\n{}",
        b.log_tail()
    );
    ensure!(a.metric_sum("switchboard_operator_leader").await? == 1.0);
    ensure!(
        held_by(&env, "operator").await?,
        "{:?}",
        holder(&env).await?
    );
    // Across several renewals, still one leader.
    env.apply_adapter(&adapter_manifest("first", "")).await?;
    env.wait_deployment("first-worker", "the leader creates the worker", |_| true)
        .await?;
    wait_reconciled(&a).await?;
    ensure!(reconciliations(&b).await? == 0.0, "the standby reconciled");
    ensure!(b.metric_sum("switchboard_operator_leader").await? == 0.0);
    Ok(())
}
