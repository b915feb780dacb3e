//! The QueueAdapter controller: validate → build (pure) → mirror the `adapters` row →
//! server-side apply (one field manager, owner references) → status, with what the worker pods'
//! kubelet says of a missing Secret. A database outage does not hold up the apply: the reconcile
//! fails after it. The operator never reads a Secret.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{PartialObjectMeta, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{self, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{Controller, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use switchboard_api::{QueueAdapter, QueueAdapterStatus};
use switchboard_store::{QueueAdapterRow, StoreError};
use switchboard_telemetry::traces::KeyValue;
use switchboard_telemetry::{Backoff, Jitter};
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;
use tracing::field::Empty;

use crate::ErrorChain;
use crate::apply::{
    ReconcileError, apply_autoscaling, apply_disruption_budget, hand_over_replicas, kubernetes,
};
use crate::build::{
    FIELD_MANAGER, INSTANCE_LABEL, InvalidAdapter, ValidAdapter, WorkerSettings, adapter_config,
    build, managed_selector, validate, worker_name,
};
use crate::metrics::{ErrorCategory, Metrics, ReconcileOutcome};
use crate::mirror::{MigratedStore, remove_orphan_rows};
use crate::pods::{CannotStart, worker_cannot_start};
use crate::runtime::refresh_runtime_status;
use crate::status::{Outcome, READY, deployment_workers, desired_status};
use crate::storage::{EventRetention, maintain_event_partitions};

/// Held on every QueueAdapter until its `adapters` row is deleted.
pub const FINALIZER: &str = "switchboard.dev/adapters-row";
const BACKOFF_INITIAL: Duration = Duration::from_millis(500);
const BACKOFF_CAP: Duration = Duration::from_secs(300);

/// A failing reconcile's requeue: 0.5 s doubling to 5 min, equal jitter (so that adapters that
/// failed together are not retried together, nor much sooner than the doubling says).
fn reconcile_backoff() -> Backoff {
    Backoff::new(BACKOFF_INITIAL, BACKOFF_CAP).with_jitter(Jitter::Equal)
}

/// What a reconcile returns: the finalizer helper wraps our errors.
pub type ReconcileResult = Result<Action, finalizer::Error<ReconcileError>>;

fn category(err: &finalizer::Error<ReconcileError>) -> ErrorCategory {
    match err {
        finalizer::Error::ApplyFailed(err) | finalizer::Error::CleanupFailed(err) => err.category(),
        finalizer::Error::AddFinalizer(_) | finalizer::Error::RemoveFinalizer(_) => {
            ErrorCategory::Kubernetes
        }
        finalizer::Error::UnnamedObject | finalizer::Error::InvalidFinalizer => {
            ErrorCategory::Build
        }
    }
}

#[derive(Debug, Default)]
struct Failures {
    attempts: u32,
    last_error: String,
}

/// Everything a reconcile needs, built once.
pub struct Context {
    client: Client,
    store: MigratedStore,
    settings: WorkerSettings,
    metrics: Arc<Metrics>,
    recorder: Recorder,
    /// A successful reconcile runs again after this long even without a change (drift repair).
    resync: Duration,
    events: EventRetention,
    failures: Mutex<HashMap<String, Failures>>,
}

impl Context {
    pub fn new(
        client: Client,
        store: MigratedStore,
        settings: WorkerSettings,
        metrics: Arc<Metrics>,
        identity: &str,
        resync: Duration,
    ) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.to_owned(),
            instance: Some(identity.to_owned()),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            store,
            settings,
            metrics,
            resync,
            events: EventRetention::default(),
            failures: Mutex::default(),
        }
    }

    /// Keeps dedup markers as `events` says (default: [`EventRetention::default`]).
    #[must_use]
    pub fn with_event_retention(mut self, events: EventRetention) -> Self {
        self.events = events;
        self
    }

    async fn publish(&self, adapter: &QueueAdapter, type_: EventType, reason: &str, note: String) {
        let event = Event {
            type_,
            reason: reason.to_owned(),
            note: Some(note),
            action: "Reconcile".to_owned(),
            secondary: None,
        };
        if let Err(err) = self
            .recorder
            .publish(&event, &adapter.object_ref(&()))
            .await
        {
            tracing::warn!(adapter = %adapter.adapter_name(), error = %ErrorChain(&err), "cannot publish event");
        }
    }

    /// Writes the status `outcome` implies, unless the adapter already has it. Returns whether
    /// it wrote.
    async fn write_status(
        &self,
        adapter: &QueueAdapter,
        outcome: Outcome<'_>,
    ) -> Result<bool, ReconcileError> {
        let status = desired_status(adapter, outcome, &Time(Timestamp::now()));
        self.record_state(adapter, &status, outcome);
        if adapter.status.as_ref() == Some(&status) {
            return Ok(false);
        }
        let patch = serde_json::json!({
            "apiVersion": QueueAdapter::api_version(&()),
            "kind": QueueAdapter::kind(&()),
            "status": status,
        });
        self.adapters(adapter)
            .patch_status(
                &adapter.name_any(),
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
            .map_err(kubernetes("patch QueueAdapter status"))?;
        Ok(true)
    }

    /// The adapter's gauges: its Ready condition, and its workers as the applied Deployment says
    /// (unknown while blocked; unchanged by a transient failure).
    fn record_state(
        &self,
        adapter: &QueueAdapter,
        status: &QueueAdapterStatus,
        outcome: Outcome<'_>,
    ) {
        let name = adapter.adapter_name();
        let ready = status
            .conditions
            .iter()
            .any(|c| c.type_ == READY && c.status == "True");
        self.metrics.adapter_ready(&name, ready);
        match outcome {
            Outcome::Applied(deployment) | Outcome::PodsCannotStart { deployment, .. } => self
                .metrics
                .adapter_workers(&name, Some(deployment_workers(deployment))),
            Outcome::Blocked { .. } => self.metrics.adapter_workers(&name, None),
            Outcome::Failed { .. } => {}
        }
    }

    /// Says `err` in the status (Degraded=True with its reason) and, when that changed the
    /// status, in a Warning Event; returns `err` to be retried with backoff. Best effort: the
    /// API server may be what failed.
    async fn report_failure(&self, adapter: &QueueAdapter, err: ReconcileError) -> ReconcileError {
        let message = ErrorChain(&err).to_string();
        let failed = Outcome::Failed {
            reason: err.reason(),
            message: &message,
        };
        if let Ok(true) = self.write_status(adapter, failed).await {
            self.publish(adapter, EventType::Warning, err.reason(), message)
                .await;
        }
        err
    }

    fn adapters(&self, adapter: &QueueAdapter) -> Api<QueueAdapter> {
        Api::namespaced(self.client.clone(), &namespace(adapter))
    }
}

fn namespace(adapter: &QueueAdapter) -> String {
    adapter.namespace().unwrap_or_else(|| "default".to_owned())
}

/// Makes the adapter's `adapters` row say what the adapter says.
async fn mirror_row(adapter: &QueueAdapter, ctx: &Context) -> Result<(), ReconcileError> {
    let config = adapter_config(&adapter.spec);
    ctx.store
        .migrated()
        .await
        .map_err(ReconcileError::Store)?
        .upsert_queue_adapter(&QueueAdapterRow {
            name: &adapter.adapter_name(),
            enabled: adapter.spec.enabled,
            config: &config,
            generation: adapter.metadata.generation.unwrap_or(0),
            uid: adapter.metadata.uid.as_deref().unwrap_or_default(),
        })
        .await
        .map_err(ReconcileError::Store)?;
    Ok(())
}

/// Mirrors the row, then applies the ConfigMap and Deployment even if mirroring failed (the
/// error is returned after them); returns the Deployment as applied.
async fn converge(
    adapter: &QueueAdapter,
    valid: &ValidAdapter<'_>,
    ctx: &Context,
) -> Result<Deployment, ReconcileError> {
    let objects = build(valid, &ctx.settings).map_err(ReconcileError::Build)?;
    let mirrored = mirror_row(adapter, ctx).await;
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    let name = worker_name(valid.name);
    Api::<ConfigMap>::namespaced(ctx.client.clone(), valid.namespace)
        .patch(&name, &apply, &Patch::Apply(&objects.config_map))
        .await
        .map_err(kubernetes("apply worker ConfigMap"))?;
    let deployments = Api::<Deployment>::namespaced(ctx.client.clone(), valid.namespace);
    let live = deployments
        .get_opt(&name)
        .await
        .map_err(kubernetes("get worker Deployment"))?;
    // KEDA's minimum, when it is to own `replicas`.
    let min_replicas = objects
        .autoscaled
        .as_ref()
        .and(adapter.spec.workload.autoscaling.as_ref())
        .map(|autoscaling| autoscaling.min_replicas);
    if let (Some(live), Some(min)) = (&live, min_replicas) {
        hand_over_replicas(&deployments, live, min).await?;
    }
    let before = live.and_then(|d| d.metadata.resource_version);
    let applied = deployments
        .patch(&name, &apply, &Patch::Apply(&objects.deployment))
        .await
        .map_err(kubernetes("apply worker Deployment"))?;
    if let (None, Some(min)) = (&before, min_replicas) {
        // Created without `replicas` (so 1): up to the minimum before KEDA is asked.
        hand_over_replicas(&deployments, &applied, min).await?;
    }
    apply_autoscaling(
        &ctx.client,
        valid.namespace,
        &name,
        objects.autoscaled.as_ref(),
    )
    .await?;
    apply_disruption_budget(
        &ctx.client,
        valid.namespace,
        &name,
        objects.disruption_budget.as_ref(),
    )
    .await?;
    let change = match before {
        None => Some(("Created", "created")),
        Some(version) if applied.metadata.resource_version.as_ref() != Some(&version) => {
            Some(("Updated", "updated"))
        }
        Some(_) => None,
    };
    if let Some((reason, verb)) = change {
        tracing::info!(adapter = %adapter.adapter_name(), deployment = %name, "worker Deployment {verb}");
        ctx.publish(
            adapter,
            EventType::Normal,
            reason,
            format!("worker Deployment {name} {verb}"),
        )
        .await;
    }
    // A database outage does not hold up the Kubernetes side; the reconcile fails after it.
    mirrored?;
    Ok(applied)
}

/// Scales the adapter's worker Deployment to zero, if there is one.
async fn stop_worker(adapter: &QueueAdapter, ctx: &Context) -> Result<(), ReconcileError> {
    let (Some(name), Some(namespace)) = (
        adapter.metadata.name.as_deref(),
        adapter.metadata.namespace.as_deref(),
    ) else {
        return Ok(());
    };
    // KEDA would scale it up again.
    apply_autoscaling(&ctx.client, namespace, &worker_name(name), None).await?;
    apply_disruption_budget(&ctx.client, namespace, &worker_name(name), None).await?;
    let zero = serde_json::json!({"spec": {"replicas": 0}});
    match Api::<Deployment>::namespaced(ctx.client.clone(), namespace)
        .patch(
            &worker_name(name),
            &PatchParams::default(),
            &Patch::Merge(&zero),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.is_not_found() => Ok(()),
        Err(err) => Err(kubernetes("scale the worker Deployment to zero")(err)),
    }
}

/// Reports that the adapter cannot run as it is, and waits for a change to it.
async fn block(
    adapter: &QueueAdapter,
    ctx: &Context,
    reason: &str,
    message: &str,
) -> Result<Action, ReconcileError> {
    ctx.metrics.reconciled(ReconcileOutcome::Blocked);
    if ctx
        .write_status(adapter, Outcome::Blocked { reason, message })
        .await?
    {
        tracing::info!(adapter = %adapter.adapter_name(), reason, message, "adapter cannot run; waiting for a change");
        ctx.publish(adapter, EventType::Warning, reason, message.to_owned())
            .await;
    }
    Ok(Action::await_change())
}

async fn apply(adapter: &QueueAdapter, ctx: &Context) -> Result<Action, ReconcileError> {
    let valid = match validate(adapter, &ctx.settings) {
        Ok(valid) => valid,
        Err(invalid) => {
            if matches!(invalid, InvalidAdapter::ImageNotAllowed { .. }) || !adapter.spec.enabled {
                // What runs already (an image allowed before, an operator upgraded since) must
                // not go on with the adapter's Secrets; a disabled adapter stops even when its
                // spec is invalid.
                stop_worker(adapter, ctx).await?;
            }
            return block(adapter, ctx, invalid.reason(), &invalid.to_string()).await;
        }
    };
    match converge(adapter, &valid, ctx).await {
        Ok(deployment) => {
            report_applied(adapter, &valid, &deployment, ctx).await?;
            ctx.metrics.reconciled(ReconcileOutcome::Applied);
            Ok(Action::requeue(ctx.resync))
        }
        Err(err) => Err(ctx.report_failure(adapter, err).await),
    }
}

/// Says in the status that the worker objects are applied, and whether a worker pod cannot
/// start (then also in a Warning Event, when that is new).
async fn report_applied(
    adapter: &QueueAdapter,
    valid: &ValidAdapter<'_>,
    deployment: &Deployment,
    ctx: &Context,
) -> Result<(), ReconcileError> {
    let cannot_start = if adapter.spec.enabled {
        worker_cannot_start(&ctx.client, valid.namespace, valid.name).await?
    } else {
        None
    };
    let outcome = match &cannot_start {
        None => Outcome::Applied(deployment),
        Some(CannotStart { reason, message }) => Outcome::PodsCannotStart {
            deployment,
            reason,
            message,
        },
    };
    if ctx.write_status(adapter, outcome).await?
        && let Some(CannotStart { reason, message }) = cannot_start
    {
        tracing::info!(adapter = %adapter.adapter_name(), reason, message, "a worker pod cannot start");
        ctx.publish(adapter, EventType::Warning, reason, message)
            .await;
    }
    Ok(())
}

async fn delete_row(store: &MigratedStore, name: &str) -> Result<bool, StoreError> {
    store.migrated().await?.delete_adapter(name).await
}

async fn cleanup(adapter: &QueueAdapter, ctx: &Context) -> Result<Action, ReconcileError> {
    let name = adapter.adapter_name();
    let deleted = match delete_row(&ctx.store, &name).await {
        Ok(deleted) => deleted,
        // The finalizer holds the object until the row is gone: say why it waits.
        Err(err) => {
            return Err(ctx
                .report_failure(adapter, ReconcileError::Store(err))
                .await);
        }
    };
    tracing::info!(adapter = %name, row_deleted = deleted, "adapter deleted; adapters row cleaned up");
    ctx.metrics.adapter_deleted(&name);
    ctx.metrics.reconciled(ReconcileOutcome::CleanedUp);
    Ok(Action::await_change())
}

/// A reconcile in its span (`reconcile QueueAdapter` when exported, with the adapter's
/// namespace, name and generation; failed with the error).
async fn reconcile(adapter: Arc<QueueAdapter>, ctx: Arc<Context>) -> ReconcileResult {
    let span = tracing::info_span!(
        target: switchboard_telemetry::traces::SPAN_TARGET,
        "reconcile",
        otel.name = Empty,
        otel.kind = Empty
    );
    switchboard_telemetry::traces::describe(
        &span,
        "reconcile QueueAdapter",
        "internal",
        [
            KeyValue::new(
                "k8s.namespace.name",
                adapter.namespace().unwrap_or_default(),
            ),
            KeyValue::new("switchboard.adapter", adapter.adapter_name()),
            KeyValue::new(
                "k8s.object.generation",
                adapter.metadata.generation.unwrap_or(0),
            ),
        ],
    );
    let result = reconcile_once(adapter, ctx).instrument(span.clone()).await;
    if let Err(err) = &result {
        switchboard_telemetry::traces::fail(&span, err);
    }
    result
}

async fn reconcile_once(adapter: Arc<QueueAdapter>, ctx: Arc<Context>) -> ReconcileResult {
    let started = Instant::now();
    let key = adapter.adapter_name();
    let api = ctx.adapters(&adapter);
    let result = finalizer(&api, FINALIZER, adapter, |event| async {
        match event {
            finalizer::Event::Apply(adapter) => apply(&adapter, &ctx).await,
            finalizer::Event::Cleanup(adapter) => cleanup(&adapter, &ctx).await,
        }
    })
    .await;
    ctx.metrics
        .reconcile_seconds
        .observe(started.elapsed().as_secs_f64());
    if result.is_ok() {
        let recovered = ctx
            .failures
            .lock()
            .map(|mut failures| failures.remove(&key).is_some())
            .unwrap_or(false);
        if recovered {
            tracing::info!(adapter = %key, "reconcile succeeded again");
        }
    }
    result
}

/// Counts the failure, logs it when it is new, and requeues with exponential backoff.
fn error_policy(
    adapter: Arc<QueueAdapter>,
    err: &finalizer::Error<ReconcileError>,
    ctx: Arc<Context>,
) -> Action {
    let category = category(err);
    ctx.metrics.failed(category);
    let key = adapter.adapter_name();
    let message = ErrorChain(err).to_string();
    let (attempts, is_new) = match ctx.failures.lock() {
        Ok(mut failures) => {
            let entry = failures.entry(key.clone()).or_default();
            entry.attempts = entry.attempts.saturating_add(1);
            let is_new = entry.last_error != message;
            entry.last_error.clone_from(&message);
            (entry.attempts, is_new)
        }
        Err(_) => (1, true),
    };
    let delay = reconcile_backoff().delay(attempts.saturating_sub(1));
    if is_new {
        tracing::warn!(adapter = %key, category = category.as_str(), error = %message, retry_in = ?delay, "reconcile failed; retrying with backoff");
    }
    Action::requeue(delay)
}

/// The adapter whose worker `pod` is (by its labels).
fn adapter_of(pod: &PartialObjectMeta<Pod>) -> Option<ObjectRef<QueueAdapter>> {
    let name = pod.labels().get(INSTANCE_LABEL)?;
    Some(ObjectRef::new(name).within(&pod.namespace()?))
}

/// Runs the controller until `stop` fires, then lets running reconciles finish.
pub async fn run_controller(ctx: Arc<Context>, stop: CancellationToken) {
    let client = ctx.client.clone();
    let managed = watcher::Config::default().labels(&managed_selector());
    let controller = Controller::new(
        Api::<QueueAdapter>::all(client.clone()),
        watcher::Config::default(),
    );
    let runtime = tokio::spawn(refresh_runtime_status(
        client.clone(),
        ctx.store.unmigrated().clone(),
        controller.store(),
        stop.clone(),
    ));
    let sweeper = tokio::spawn(remove_orphan_rows(
        client.clone(),
        ctx.store.clone(),
        ctx.resync,
        stop.clone(),
    ));
    let events = tokio::spawn(maintain_event_partitions(
        ctx.store.clone(),
        ctx.events,
        ctx.metrics.clone(),
        stop.clone(),
    ));
    controller
        .owns(Api::<Deployment>::all(client.clone()), managed.clone())
        .owns(Api::<ConfigMap>::all(client.clone()), managed.clone())
        // A worker pod's change (waiting for a missing Secret, started) triggers its adapter,
        // whose reconcile reads the pods' status. No Secret is ever read or watched.
        .watches(Api::<PartialObjectMeta<Pod>>::all(client), managed, |pod| {
            adapter_of(&pod)
        })
        .graceful_shutdown_on(async move { stop.cancelled_owned().await })
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            // Reconcile failures are logged by `error_policy`; these are the controller's own.
            if let Err(err) = result
                && !matches!(err, kube::runtime::controller::Error::ReconcilerFailed(..))
            {
                tracing::warn!(error = %ErrorChain(&err), "controller error");
            }
        })
        .await;
    let _ = runtime.await;
    let _ = sweeper.await;
    let _ = events.await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconcile_backoff_doubles_from_half_a_second_and_is_capped() {
        let backoff = reconcile_backoff();
        assert_eq!(backoff.ceiling(0), Duration::from_millis(500));
        assert_eq!(backoff.ceiling(1), Duration::from_secs(1));
        assert_eq!(backoff.ceiling(3), Duration::from_secs(4));
        assert_eq!(backoff.ceiling(39), BACKOFF_CAP);
        for attempt in [0, 3, 39] {
            let delay = backoff.delay(attempt);
            let ceiling = backoff.ceiling(attempt);
            assert!(delay >= ceiling / 2 && delay <= ceiling, "{delay:?}");
        }
    }
}
