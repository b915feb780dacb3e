//! The gateway transport beyond the contract suite, end to end: the real worker binary, real
//! PostgreSQL, the test gateway (tests/src/brokers/gateway.rs) in front of a real ElasticMQ,
//! and tokens from a real Ory Hydra.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use axum::http::StatusCode;
use switchboard_api::source::gateway::CA_ENV;
use switchboard_tests::brokers::gateway::TestCa;
use switchboard_tests::brokers::{BrokerFixture, GatewayBroker};
use switchboard_tests::send::round_trip;
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::WorkerProcess;
use switchboard_tests::{Fixture, source_manifest};

const LONG: Duration = Duration::from_secs(120);
/// A misconfigured worker exits within this.
const FATAL_EXIT: Duration = Duration::from_secs(30);

fn bodies(name: &str, range: std::ops::Range<usize>) -> Vec<Vec<u8>> {
    range
        .map(|i| format!(r#"{{"{name}":{i}}}"#).into_bytes())
        .collect()
}

/// PostgreSQL, the gateway's peers and queue `name`, with tokens living `token_lifetime`.
struct Setup {
    fx: Fixture,
    broker: GatewayBroker,
    name: &'static str,
}

impl Setup {
    async fn start(
        name: &'static str,
        token_lifetime: Duration,
        ca: Option<&TestCa>,
    ) -> Result<Self> {
        let mut fx = Fixture::start().await?;
        let (broker, env) = GatewayBroker::start_with(token_lifetime, ca)?;
        fx.extra_env = env;
        broker.create_queues(name).await?;
        Ok(Self { fx, broker, name })
    }

    fn worker(&self) -> Result<WorkerProcess> {
        self.worker_with("w1", "", &[])
    }

    /// Worker `consumer` with more `gateway` fields (`tls: …`) and environment.
    fn worker_with(
        &self,
        consumer: &str,
        more: &str,
        env: &[(&str, &str)],
    ) -> Result<WorkerProcess> {
        let source = self
            .broker
            .source(self.name, &format!("visibilityTimeoutSeconds: 2{more}"));
        let manifest = self.fx.manifest(
            &format!("{}-{consumer}.yaml", self.name),
            &source_manifest(self.name, &source, "batchSize: 50", ""),
        )?;
        self.fx.worker_with(&manifest, consumer, env)
    }

    async fn produce(&self, bodies: Vec<Vec<u8>>) -> Result<()> {
        self.broker.produce(&self.fx, self.name, bodies).await
    }

    /// Waits until `expected` todos exist and nothing is left un-acknowledged.
    async fn wait_settled(&self, expected: i64, worker: &WorkerProcess) -> Result<()> {
        wait_for(
            LONG,
            &format!("{expected} todos, nothing un-acknowledged"),
            || async {
                Ok(self.fx.todo_count(self.name).await? >= expected
                    && self.broker.unacknowledged(&self.fx, self.name).await? == 0)
            },
        )
        .await
        .map_err(|err| err.context(worker.log_tail()))?;
        self.fx.assert_exactly_once(self.name, expected).await
    }
}

/// Acceptance 2: tokens of a real OAuth2 server living 5 s, a 60 s run with two forced
/// revocations: no call of the worker fails with 401 (each call refused with a revoked token
/// succeeds on its retry), each revocation costs exactly one extra token request however many
/// calls it met, the token endpoint is otherwise called once per lifetime, and no token
/// appears in the worker's log or metrics.
#[tokio::test]
async fn five_second_tokens_over_a_minute_are_refreshed_before_expiry_without_a_401_storm()
-> Result<()> {
    const RUN: Duration = Duration::from_secs(60);
    const REVOCATIONS: u64 = 2;
    /// How long after a revocation the calls in flight with the revoked token are answered.
    const SETTLE: Duration = Duration::from_secs(3);
    /// Calls that may reach the gateway after their token ended: one sent in the last second
    /// of a token's life and delayed in transit on a loaded machine. A worker that waits for
    /// the 401 instead of refreshing meets one per token lifetime (15 in the run).
    const LATE: u64 = 2;
    let setup = Setup::start("tokens", Duration::from_secs(5), None).await?;
    let hooks = setup.broker.gateway.hooks();
    let worker = setup.worker()?;
    let metric =
        |name: &str| worker.metric(&format!(r#"switchboard_{name}{{adapter="test/tokens"}}"#));
    let started = Instant::now();
    let mut produced = 0;
    let mut revoked = 0;
    // 401 answers come from revocations, and from expiry at most `LATE` times.
    let mut settled_401 = hooks.answered(401);
    // Per revocation: (401 answers of the gateway, token requests it forced).
    let mut per_revocation = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while started.elapsed() < RUN {
        tick.tick().await;
        setup
            .produce(bodies("tokens", produced..produced + 10))
            .await?;
        produced += 10;
        ensure!(
            hooks.expired() <= LATE,
            "the gateway refused {} calls for a token used past its expiry:\n{}",
            hooks.expired(),
            worker.log_tail()
        );
        let due = started.elapsed().as_secs() / (RUN.as_secs() / (REVOCATIONS + 1));
        if revoked < REVOCATIONS && due > revoked {
            // Right after the worker starts using a new token, so that the revocation is not
            // dodged by a refresh due anyway (the next one is 3.6 s away).
            let seen = hooks.seen_tokens();
            wait_for(LONG, "the worker presents a new token", || async {
                Ok(hooks.seen_tokens() > seen)
            })
            .await?;
            let forced = metric("gateway_token_refreshes_forced_total")?;
            ensure!(hooks.revoke_seen_tokens() > 0, "a token was in use");
            revoked += 1;
            let revocation = Instant::now();
            wait_for(LONG, "the revoked token replaced", || async {
                Ok(metric("gateway_token_refreshes_forced_total")? > forced)
            })
            .await
            .map_err(|err| err.context(worker.log_tail()))?;
            wait_for(LONG, "the calls in flight answered", || async {
                Ok(revocation.elapsed() >= SETTLE)
            })
            .await?;
            per_revocation.push((
                hooks.answered(401) - settled_401,
                metric("gateway_token_refreshes_forced_total")? - forced,
            ));
            settled_401 = hooks.answered(401);
        }
    }
    setup.wait_settled(produced as i64, &worker).await?;
    let elapsed = started.elapsed().as_secs_f64();
    let log = worker.log();
    // (a) No call failed with 401 after its retry.
    ensure!(
        metric("gateway_auth_failures_total")? == 0.0 && !log.contains("refused twice"),
        "a call failed with 401 after a new token:\n{}",
        worker.log_tail()
    );
    // (b) A revocation meets every call in flight with the revoked token (up to 16
    // concurrent deletes of a batch, a long poll, a probe): each gets one 401, and all of them
    // together cause exactly one token request.
    ensure!(
        per_revocation.len() == REVOCATIONS as usize
            && per_revocation
                .iter()
                .all(|&(refused, forced)| refused >= 1 && forced == 1.0),
        "(401 answers, forced token requests) per revocation: {per_revocation:?}"
    );
    let unauthorized = hooks.answered(401);
    ensure!(
        metric("gateway_unauthorized_total")? == unauthorized as f64,
        "the worker counts the 401 answers"
    );
    // (c) Counted at the real token endpoint: Hydra says `expires_in: 4` for a 5 s token,
    // refreshed a second early (3 s) by the first call after, so once per 3 to 4 s; plus one
    // per revocation; never a storm.
    // The worker keeps refreshing its token while this reads, and Hydra logs a request once it
    // has answered it: the two counts agree once no request is between them.
    wait_for(
        LONG,
        "the worker counts its token requests as Hydra does",
        || async {
            Ok(metric("gateway_token_requests_total")?
                == setup.broker.hydra.token_requests()? as f64)
        },
    )
    .await?;
    let requests = setup.broker.hydra.token_requests()? as f64;
    // A late call's refusal forces a token request too.
    let scheduled = requests - REVOCATIONS as f64 - hooks.expired() as f64;
    ensure!(
        scheduled >= elapsed / 5.0 && scheduled <= elapsed / 3.0 + 1.0,
        "{requests} token requests in {elapsed:.0} s of 4 s tokens with {REVOCATIONS} revocations"
    );
    let (_, metrics) = worker.http_get("/metrics")?;
    let tokens = hooks.tokens();
    ensure!(
        tokens.len() as f64 >= elapsed / 5.0,
        "{} tokens",
        tokens.len()
    );
    for token in tokens {
        ensure!(!log.contains(&token), "a token is in the worker's log");
        ensure!(!metrics.contains(&token), "a token is in the metrics");
    }
    ensure!(
        !log.contains(&setup.broker.client.secret),
        "the client secret is in the worker's log"
    );
    println!(
        "tokens: {produced} messages in {elapsed:.1} s, {requests} token requests, \
         {unauthorized} answers 401 ((401 answers, forced token requests) per revocation: \
         {per_revocation:?}), no call failed"
    );
    Ok(())
}

/// Acceptance 3: the gateway answers 429 for 5 s and then 503 for 5 s: the worker backs off,
/// its circuit opens and goes half-open, and every message is stored exactly once.
#[tokio::test]
async fn gateway_answering_429_then_503_for_ten_seconds_opens_the_circuit_and_loses_nothing()
-> Result<()> {
    let setup = Setup::start("overload", Duration::from_secs(300), None).await?;
    let hooks = setup.broker.gateway.hooks();
    let worker = setup.worker()?;
    setup.produce(bodies("overload", 0..200)).await?;
    setup.wait_settled(200, &worker).await?;

    let outage = Instant::now();
    hooks.fail_for(StatusCode::TOO_MANY_REQUESTS, Duration::from_secs(5));
    setup.produce(bodies("overload", 200..400)).await?;
    wait_for(LONG, "readiness turns false", || async {
        Ok(worker.http_get("/readyz")?.0 == 503)
    })
    .await?;
    wait_for(LONG, "5 s of 429", || async {
        Ok(outage.elapsed() >= Duration::from_secs(5))
    })
    .await?;
    hooks.fail_for(StatusCode::SERVICE_UNAVAILABLE, Duration::from_secs(5));
    wait_for(LONG, "5 s of 503", || async {
        Ok(outage.elapsed() >= Duration::from_secs(10))
    })
    .await?;
    let refused = hooks.answered(429) + hooks.answered(503);
    setup.wait_settled(400, &worker).await?;
    wait_for(LONG, "readiness returns", || async {
        Ok(worker.http_get("/readyz")?.0 == 200)
    })
    .await?;

    let log = worker.log();
    let at = |needle: &str| log.find(needle);
    let (Some(open), Some(half_open), Some(closed)) = (
        at("gateway circuit open"),
        at("gateway circuit half-open"),
        at("gateway circuit closed"),
    ) else {
        anyhow::bail!(
            "the circuit did not open, probe and close:\n{}",
            worker.log_tail()
        );
    };
    ensure!(
        open < half_open && half_open < closed,
        "open, then half-open, then closed"
    );
    ensure!(
        worker.metric(r#"switchboard_gateway_circuit_opened_total{adapter="test/overload"}"#)?
            >= 1.0
    );
    // Backoff and the open circuit keep the calls few: no tight loop against the gateway.
    ensure!(refused >= 5, "the gateway refused calls: {refused}");
    ensure!(
        refused <= 60,
        "{refused} calls refused in 10 s: not backing off"
    );
    println!("overload: {refused} calls refused during the 10 s outage");
    Ok(())
}

/// Acceptance 3: a 403 (the token is valid, its claims do not allow the queue) degrades the
/// worker — readiness false, one log line naming the queue and the claims, backoff, no exit —
/// and it recovers once the grant is fixed.
#[tokio::test]
async fn gateway_answering_403_degrades_the_worker_naming_the_queue_and_the_claims() -> Result<()> {
    let setup = Setup::start("forbidden", Duration::from_secs(300), None).await?;
    let hooks = setup.broker.gateway.hooks();
    let worker = setup.worker()?;
    setup.produce(bodies("forbidden", 0..20)).await?;
    setup.wait_settled(20, &worker).await?;

    hooks.fail_for(StatusCode::FORBIDDEN, Duration::from_secs(300));
    setup.produce(bodies("forbidden", 20..40)).await?;
    wait_for(LONG, "readiness turns false", || async {
        Ok(worker.http_get("/readyz")?.0 == 503)
    })
    .await?;
    let named = |log: &str| {
        log.lines().any(|line| {
            line.contains("queue forbidden")
                && line.contains("403")
                && line.contains("aud https://gateway.switchboard.test")
                && line.contains("scopes [sqs]")
        })
    };
    wait_for(
        LONG,
        "a log line naming the queue and the claims",
        || async { Ok(named(&worker.log())) },
    )
    .await
    .map_err(|err| err.context(worker.log_tail()))?;
    let first = hooks.answered(403);
    let degraded = Instant::now();
    wait_for(LONG, "10 s degraded", || async {
        ensure!(
            worker.http_get("/healthz")?.0 == 200,
            "the worker stays up (and live) on a 403"
        );
        Ok(degraded.elapsed() >= Duration::from_secs(10))
    })
    .await?;
    let during = hooks.answered(403) - first;
    // Backing off: a tight loop would be hundreds a second.
    ensure!(
        during <= 60,
        "{during} calls refused in 10 s: not backing off"
    );
    println!("forbidden: {during} calls refused in 10 s of 403");

    hooks.stop_failing();
    setup.wait_settled(40, &worker).await?;
    wait_for(LONG, "readiness returns", || async {
        Ok(worker.http_get("/readyz")?.0 == 200)
    })
    .await
}

/// Acceptance 4: `switchboard-worker send --file MANIFEST --attr k=v < body` through the
/// gateway, into a todo whose event carries the body and the attributes.
#[tokio::test]
async fn send_round_trip_through_the_gateway_ends_in_one_todo() -> Result<()> {
    round_trip::<GatewayBroker>("gateway").await
}

/// TLS with a custom CA (`spec.source.gateway.tls`): the gateway serves HTTPS only, with a
/// certificate of a CA generated here. Without the CA the worker exits non-zero naming
/// `spec.source.gateway.tls`, having sent nothing to the unverified peer; with it (the file
/// `GATEWAY_CA_FILE` names, as the operator mounts it) the messages become todos.
#[tokio::test]
async fn gateway_over_tls_is_trusted_with_its_custom_ca_and_refused_without_it() -> Result<()> {
    let ca = TestCa::generate()?;
    let setup = Setup::start("tls", Duration::from_secs(300), Some(&ca)).await?;
    let hooks = setup.broker.gateway.hooks();
    ensure!(setup.broker.gateway.url().starts_with("https://127.0.0.1:"));
    setup.produce(bodies("tls", 0..20)).await?;

    let mut untrusted = setup.worker_with("untrusted", "", &[])?;
    let status = untrusted.wait_exit(FATAL_EXIT)?;
    let log = untrusted.log();
    ensure!(
        !status.success() && status.code().is_some(),
        "without the CA: expected a non-zero exit, got {status:?}\n{log}"
    );
    ensure!(
        log.lines()
            .any(|line| line.contains("spec.source.gateway.tls")
                && line.contains("not trusted")
                && line.contains("caConfigMapRef or caSecretRef")),
        "the log names the TLS setting:\n{log}"
    );
    // The gateway's accept task records the failed handshake on its own time: the worker may
    // have exited first.
    wait_for(
        Duration::from_secs(10),
        "the worker refused the certificate in the handshake",
        || async { Ok(hooks.handshake_failures() >= 1) },
    )
    .await?;
    ensure!(
        hooks.tokens().is_empty(),
        "no request reached the unverified peer"
    );
    ensure!(setup.fx.todo_count("tls").await? == 0, "nothing stored");

    let ca_file = setup.fx.manifest("gateway-ca.crt", &ca.ca_pem)?;
    let ca_file = ca_file.to_str().context("a UTF-8 path")?;
    let worker = setup.worker_with(
        "w1",
        ", tls: {caConfigMapRef: {name: gateway-ca, key: ca.crt}}",
        &[(CA_ENV, ca_file)],
    )?;
    setup.wait_settled(20, &worker).await?;
    ensure!(
        !hooks.tokens().is_empty(),
        "the worker called the gateway over TLS"
    );
    Ok(())
}

/// Issue 27: one message whose attribute value is `5` (a number, where the protocol says text)
/// among nine good ones. Before, it failed the whole receive: the nine were received again and
/// again, never stored, and the log blamed an unavailable gateway. Now it alone is
/// dead-lettered (its body byte-identical, its JSON in the error) and the nine are stored on
/// their first delivery.
#[tokio::test]
async fn attribute_that_is_not_a_string_dead_letters_its_message_and_spares_the_other_nine()
-> Result<()> {
    let setup = Setup::start("numbers", Duration::from_secs(300), None).await?;
    let good = bodies("numbers", 0..9);
    setup.produce(good[..4].to_vec()).await?;
    let odd = br#"{"odd":5}"#.to_vec();
    setup
        .broker
        .produce_undecodable(&setup.fx, setup.name, odd.clone())
        .await?;
    setup.produce(good[4..].to_vec()).await?;
    let worker = setup.worker()?;
    wait_for(
        LONG,
        "9 todos, one dead letter, nothing un-acknowledged",
        || async {
            Ok(setup.fx.todo_count(setup.name).await? >= 9
                && setup
                    .broker
                    .dead_letters(&setup.fx, setup.name)
                    .await?
                    .len()
                    == 1
                && setup.broker.unacknowledged(&setup.fx, setup.name).await? == 0)
        },
    )
    .await
    .with_context(|| worker.log_tail())?;
    setup.fx.assert_stored_exactly(setup.name, &good).await?;
    let letters = setup.broker.sqs.dead_letter_messages(setup.name).await?;
    let [letter] = letters.as_slice() else {
        anyhow::bail!("one dead letter: {letters:?}");
    };
    let reason = switchboard_tests::brokers::SqsBroker::attribute(letter, "x-dlq-reason");
    let error = switchboard_tests::brokers::SqsBroker::attribute(letter, "x-dlq-error");
    ensure!(reason == "undecodable", "{reason}");
    ensure!(
        error.contains("\"n\"") && error.contains("a number (5)"),
        "the error names the attribute and quotes the message: {error}"
    );
    ensure!(
        setup.broker.dead_letters(&setup.fx, setup.name).await?[0].0 == odd,
        "the body is byte-identical"
    );
    let redelivered =
        worker.metric(r#"switchboard_messages_redelivered_total{adapter="test/numbers"}"#)?;
    ensure!(
        redelivered == 0.0,
        "nothing was received twice\n{}",
        worker.log_tail()
    );
    ensure!(
        !worker.log().contains("dependency unavailable"),
        "a gateway that is fine is not reported unavailable\n{}",
        worker.log_tail()
    );
    Ok(())
}

/// Issue 27: a dead letter the gateway refuses for good (413) is kept in PostgreSQL and the
/// batch around it is stored and deleted. Before, the write was retried forever and the
/// batch, good messages included, was never acknowledged.
#[tokio::test]
async fn dead_letter_the_gateway_refuses_is_kept_in_postgresql_and_its_batch_deleted() -> Result<()>
{
    let setup = Setup::start("refusing", Duration::from_secs(300), None).await?;
    setup
        .broker
        .refuse_dead_letters(&setup.fx, setup.name)
        .await?;
    let good = bodies("refusing", 0..9);
    let poison = b"{\"broken\"".to_vec();
    let mut all = good.clone();
    all.insert(4, poison.clone());
    setup.produce(all).await?;
    let source = setup
        .broker
        .source(setup.name, "visibilityTimeoutSeconds: 2");
    let manifest = setup.fx.manifest(
        "refusing.yaml",
        &source_manifest(setup.name, &source, "batchSize: 50", "format: json"),
    )?;
    let worker = setup.fx.worker(&manifest, "w1")?;
    wait_for(
        LONG,
        "9 todos, one kept letter, nothing un-acknowledged",
        || async {
            Ok(setup.fx.todo_count(setup.name).await? >= 9
                && !setup.fx.database_dead_letters(setup.name).await?.is_empty()
                && setup.broker.unacknowledged(&setup.fx, setup.name).await? == 0)
        },
    )
    .await
    .with_context(|| worker.log_tail())?;
    setup.fx.assert_stored_exactly(setup.name, &good).await?;
    let kept = setup.fx.database_dead_letters(setup.name).await?;
    ensure!(
        kept == vec![(poison, "invalid_json".to_owned())],
        "one letter kept, byte-identical: {kept:?}"
    );
    ensure!(setup.broker.gateway.hooks().answered(413) >= 1);
    Ok(())
}

/// Every wait has a deadline: a gateway that takes a receive and never answers fails that
/// receive within `waitTimeSeconds` + the margin (readiness false), and the worker carries on
/// once it answers again.
#[tokio::test]
async fn hung_gateway_receive_times_out_and_the_worker_carries_on() -> Result<()> {
    let setup = Setup::start("hung", Duration::from_secs(300), None).await?;
    let worker = setup.worker()?;
    setup.produce(bodies("hung", 0..10)).await?;
    setup.wait_settled(10, &worker).await?;
    let hooks = setup.broker.gateway.hooks();
    hooks.hang_receives(true);
    let held = Instant::now();
    wait_for(
        LONG,
        "the held receive times out: readiness false",
        || async { Ok(worker.http_get("/readyz")?.0 == 503) },
    )
    .await
    .with_context(|| worker.log_tail())?;
    ensure!(
        held.elapsed() < Duration::from_secs(40),
        "the receive's deadline is waitTimeSeconds plus a margin, not {:?}",
        held.elapsed()
    );
    hooks.hang_receives(false);
    setup.produce(bodies("later", 0..10)).await?;
    setup.wait_settled(20, &worker).await?;
    wait_for(LONG, "readiness returns", || async {
        Ok(worker.http_get("/readyz")?.0 == 200)
    })
    .await
}
