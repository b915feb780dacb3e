//! Leader election through a `coordination.k8s.io/v1` Lease, the way client-go does it: the
//! holder renews the lease; a candidate takes it once the record has not changed for a whole
//! lease duration (measured on the candidate's own clock, so clocks need not agree); writes use
//! the read's resourceVersion, so two candidates never both win. A holder that stops gracefully
//! releases the lease so the next one takes over at once.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

/// `name` plus `_` and a random suffix, as client-go builds a Lease identity: two replicas with
/// the same host name (hostNetwork pods on one node, two runs outside the cluster) must not
/// both believe they hold the lease.
pub fn unique_identity(name: &str) -> String {
    format!("{name}_{:016x}", fastrand::u64(..))
}

/// Which Lease, who we are, how long a lease lasts.
#[derive(Debug, Clone)]
pub struct LeaseSettings {
    pub name: String,
    pub namespace: String,
    pub identity: String,
    pub duration: Duration,
}

/// Why leadership ended or could not be had.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("lost the leader lease {name}: not renewed within {duration:?}")]
    Lost { name: String, duration: Duration },
    #[error("cannot read or write the leader lease")]
    Kubernetes(#[source] kube::Error),
}

/// The last lease record seen, and when it was first seen on our clock.
struct Observed {
    holder: Option<String>,
    renew_time: Option<MicroTime>,
    since: Instant,
}

/// One candidate for the lease.
pub struct LeaderElector {
    api: Api<Lease>,
    settings: LeaseSettings,
    observed: Option<Observed>,
}

impl LeaderElector {
    pub fn new(client: Client, settings: LeaseSettings) -> Self {
        Self {
            api: Api::namespaced(client, &settings.namespace),
            settings,
            observed: None,
        }
    }

    fn renew_interval(&self) -> Duration {
        self.settings.duration / 3
    }

    fn duration_seconds(&self) -> i32 {
        i32::try_from(self.settings.duration.as_secs().max(1)).unwrap_or(i32::MAX)
    }

    /// Remembers `spec` and returns whether its holder has let it expire.
    fn observe(&mut self, spec: &LeaseSpec) -> bool {
        let changed = self.observed.as_ref().is_none_or(|seen| {
            seen.holder != spec.holder_identity || seen.renew_time != spec.renew_time
        });
        if changed {
            self.observed = Some(Observed {
                holder: spec.holder_identity.clone(),
                renew_time: spec.renew_time.clone(),
                since: Instant::now(),
            });
        }
        let duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(self.settings.duration, Duration::from_secs);
        self.observed
            .as_ref()
            .is_some_and(|seen| seen.since.elapsed() >= duration)
    }

    fn spec_for_us(&self, previous: Option<&LeaseSpec>) -> LeaseSpec {
        let now = MicroTime(Timestamp::now());
        let ours = previous.and_then(|p| p.holder_identity.as_deref())
            == Some(self.settings.identity.as_str());
        let transitions = previous.and_then(|p| p.lease_transitions).unwrap_or(0);
        LeaseSpec {
            holder_identity: Some(self.settings.identity.clone()),
            lease_duration_seconds: Some(self.duration_seconds()),
            acquire_time: if ours {
                previous.and_then(|p| p.acquire_time.clone())
            } else {
                Some(now.clone())
            },
            renew_time: Some(now),
            lease_transitions: Some(if ours || previous.is_none() {
                transitions
            } else {
                transitions + 1
            }),
            ..LeaseSpec::default()
        }
    }

    /// One attempt to take or renew the lease. `Ok(true)`: we hold it now.
    pub async fn try_acquire_or_renew(&mut self) -> Result<bool, LeaseError> {
        let existing = self
            .api
            .get_opt(&self.settings.name)
            .await
            .map_err(LeaseError::Kubernetes)?;
        let Some(mut lease) = existing else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.settings.name.clone()),
                    namespace: Some(self.settings.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(self.spec_for_us(None)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(err) if is_conflict(&err) => Ok(false),
                Err(err) => Err(LeaseError::Kubernetes(err)),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.as_deref().unwrap_or_default();
        let expired = self.observe(&spec);
        if holder != self.settings.identity && !holder.is_empty() && !expired {
            return Ok(false);
        }
        lease.spec = Some(self.spec_for_us(Some(&spec)));
        match self
            .api
            .replace(&self.settings.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(err) if is_conflict(&err) => Ok(false),
            Err(err) => Err(LeaseError::Kubernetes(err)),
        }
    }

    /// Waits until we hold the lease. `Ok(false)`: `cancel` fired first.
    pub async fn acquire(&mut self, cancel: &CancellationToken) -> Result<bool, LeaseError> {
        let mut logged = false;
        loop {
            match self.try_acquire_or_renew().await {
                Ok(true) => {
                    tracing::info!(lease = %self.settings.name, identity = %self.settings.identity, "acquired the leader lease");
                    return Ok(true);
                }
                Ok(false) if !logged => {
                    tracing::info!(lease = %self.settings.name, "another replica leads; standing by");
                    logged = true;
                }
                Ok(false) => {}
                Err(err) => {
                    tracing::warn!(error = %crate::ErrorChain(&err), "leader election attempt failed")
                }
            }
            tokio::select! {
                () = cancel.cancelled() => return Ok(false),
                () = tokio::time::sleep(self.renew_interval()) => {}
            }
        }
    }

    /// Renews the lease until `stop` fires (then releases it) or a renewal is missed for a whole
    /// lease duration (then returns [`LeaseError::Lost`]).
    pub async fn hold(&mut self, stop: &CancellationToken) -> Result<(), LeaseError> {
        let mut last_renewal = Instant::now();
        loop {
            tokio::select! {
                () = stop.cancelled() => return self.release().await,
                () = tokio::time::sleep(self.renew_interval()) => {}
            }
            match self.try_acquire_or_renew().await {
                Ok(true) => last_renewal = Instant::now(),
                Ok(false) => {
                    return Err(LeaseError::Lost {
                        name: self.settings.name.clone(),
                        duration: self.settings.duration,
                    });
                }
                Err(err) => {
                    tracing::warn!(error = %crate::ErrorChain(&err), "renewing the leader lease failed");
                }
            }
            if last_renewal.elapsed() >= self.settings.duration {
                return Err(LeaseError::Lost {
                    name: self.settings.name.clone(),
                    duration: self.settings.duration,
                });
            }
        }
    }

    /// Gives the lease up so another replica takes over without waiting for it to expire.
    async fn release(&mut self) -> Result<(), LeaseError> {
        let Some(mut lease) = self
            .api
            .get_opt(&self.settings.name)
            .await
            .map_err(LeaseError::Kubernetes)?
        else {
            return Ok(());
        };
        let Some(spec) = lease.spec.as_mut() else {
            return Ok(());
        };
        if spec.holder_identity.as_deref() != Some(self.settings.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        match self
            .api
            .replace(&self.settings.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => {
                tracing::info!(lease = %self.settings.name, "released the leader lease");
                Ok(())
            }
            Err(err) if is_conflict(&err) => Ok(()),
            Err(err) => Err(LeaseError::Kubernetes(err)),
        }
    }
}

fn is_conflict(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == 409)
}
