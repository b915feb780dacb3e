//! PostgreSQL over TLS with a private CA (CloudNativePG's default): with the CA in
//! `PGSSLROOTCERT` (what the operator mounts from `spec.database.caSecretRef`/`caConfigMapRef`)
//! and `sslmode=verify-full` the worker stores messages; without it the worker exits at once,
//! naming the settings, instead of retrying forever.

use std::time::Duration;

use anyhow::{Result, ensure};
use switchboard_tests::Fixture;
use switchboard_tests::brokers::gateway::TestCa;
use switchboard_tests::servers::Postgres;
use switchboard_tests::wait::wait_for;

/// A fixture whose workers reach PostgreSQL over TLS with `sslmode=verify-full`, and the CA's
/// file.
async fn tls_fixture() -> Result<(Fixture, std::path::PathBuf)> {
    let ca = TestCa::generate()?;
    let mut fx = Fixture::start_with(Postgres::start_tls(&ca)?).await?;
    fx.env.database_url = format!(
        "postgres://postgres@localhost:{}/postgres?sslmode=verify-full",
        fx.postgres.port()
    );
    let ca_file = fx.dir.path().join("ca.crt");
    std::fs::write(&ca_file, &ca.ca_pem)?;
    Ok((fx, ca_file))
}

#[tokio::test]
async fn worker_trusts_the_database_ca_in_pgsslrootcert_with_verify_full() -> Result<()> {
    let (fx, ca_file) = tls_fixture().await?;
    let manifest = fx.stream_adapter("tls", "batchSize: 10", "")?;
    fx.produce("tls", (0..3).map(|i| format!("{{\"n\":{i}}}").into_bytes()))?;
    let ca = ca_file.to_str().expect("utf-8 path");
    let worker = fx.worker_with(&manifest, "w1", &[("PGSSLROOTCERT", ca)])?;
    wait_for(
        Duration::from_secs(30),
        "3 todos stored over TLS",
        || async { Ok(fx.todo_count("tls").await? == 3) },
    )
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    let tls: Option<bool> = sqlx::query_scalar(
        "SELECT bool_and(s.ssl) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
         WHERE a.application_name LIKE 'switchboard-worker%'",
    )
    .fetch_one(fx.pool())
    .await?;
    ensure!(tls == Some(true), "the worker's connections use TLS");
    Ok(())
}

#[tokio::test]
async fn worker_without_the_database_ca_exits_naming_the_setting() -> Result<()> {
    let (fx, _ca_file) = tls_fixture().await?;
    let manifest = fx.stream_adapter("untrusted", "batchSize: 10", "")?;
    let mut worker = fx.worker(&manifest, "w1")?;
    let status = worker.wait_exit(Duration::from_secs(30))?;
    let log = worker.log();
    ensure!(!status.success(), "a fatal exit, got {status:?}\n{log}");
    ensure!(
        log.contains("PGSSLROOTCERT")
            && log.contains("spec.database.caSecretRef")
            && log.contains("sslmode=verify-full"),
        "the error names the settings:\n{log}"
    );
    ensure!(
        !log.contains("unreachable"),
        "a refused certificate is not an unreachable database:\n{log}"
    );
    Ok(())
}
