//! KEDA's own operator (`scripts/keda-operator.sh` builds it once from the Go module proxy,
//! cached, or takes `KEDA_OPERATOR_BIN`) against a [`ControlPlane`], as a child process on
//! loopback ports with the admin's kubeconfig: the part of KEDA that reads each ScaledObject's
//! triggers and scales its Deployment between zero and one. No metrics API server runs (nothing
//! here runs the HPA either), so only that part is tested with it.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};

use anyhow::{Context, Result, ensure};

use super::{ControlPlane, START_TIMEOUT, http_get, kill, log_tail, openssl, spawn_logged};
use crate::servers::free_ports;
use crate::wait::wait_for;

/// The KEDA release `scripts/keda-operator.sh` and `scripts/keda-crds.sh` take.
pub const KEDA_VERSION: &str = "2.21.0";

/// A running `keda-operator`, killed on drop.
#[derive(Debug)]
pub struct KedaOperator {
    child: Child,
    log: PathBuf,
}

impl KedaOperator {
    /// Starts KEDA's operator on `plane` (KEDA's CRDs must be installed), watching every
    /// namespace, its log and certificates in `dir`; returns once its readiness probe answers.
    pub async fn start(plane: &ControlPlane, dir: &Path) -> Result<Self> {
        // KEDA's metrics gRPC service wants a certificate even when nothing calls it.
        let certs = dir.join("keda-certs");
        std::fs::create_dir_all(&certs)?;
        let mut args = [
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=keda-operator",
            "-keyout",
        ]
        .map(OsString::from)
        .to_vec();
        args.extend([
            certs.join("tls.key").into(),
            "-out".into(),
            certs.join("tls.crt").into(),
        ]);
        openssl(&args)?;
        std::fs::copy(certs.join("tls.crt"), certs.join("ca.crt"))?;
        let [metrics, probe, service] = free_ports()?;
        let probe_addr: SocketAddr = format!("127.0.0.1:{probe}").parse()?;
        let log = dir.join("keda-operator.log");
        let child = spawn_logged(
            Command::new(binary()?)
                .arg(format!("--metrics-bind-address=127.0.0.1:{metrics}"))
                .arg(format!("--health-probe-bind-address={probe_addr}"))
                .arg(format!(
                    "--metrics-service-bind-address=127.0.0.1:{service}"
                ))
                .arg(format!("--cert-dir={}", certs.display()))
                .arg(format!("--ca-dir={}", certs.display()))
                .arg("--zap-log-level=info")
                .env_clear()
                .env("KUBECONFIG", &plane.admin_kubeconfig)
                .env("WATCH_NAMESPACE", "")
                .env("POD_NAMESPACE", "keda")
                .env("KEDA_CLUSTER_OBJECT_NAMESPACE", "keda"),
            &log,
        )?;
        let keda = Self { child, log };
        wait_for(START_TIMEOUT, "keda-operator's /readyz is 200", || async {
            Ok(matches!(
                http_get(probe_addr, "/readyz").await,
                Ok((200, _))
            ))
        })
        .await
        .with_context(|| keda.log_tail())?;
        Ok(keda)
    }

    pub fn log_tail(&self) -> String {
        log_tail(&self.log, 40)
    }
}

impl Drop for KedaOperator {
    fn drop(&mut self) {
        kill(&mut self.child);
    }
}

/// `$KEDA_OPERATOR_BIN`, else the binary `scripts/keda-operator.sh` builds into the cache.
fn binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("KEDA_OPERATOR_BIN").filter(|v| !v.is_empty()) {
        return Ok(path.into());
    }
    let path = crate::brokers::cache_dir()?
        .join(format!("keda-{KEDA_VERSION}"))
        .join("keda-operator");
    ensure!(
        path.is_file(),
        "KEDA {KEDA_VERSION}'s operator is not built in {}: run `make keda-operator` (or \
         `scripts/keda-operator.sh`; needs Go, see docs/testing.md), or set KEDA_OPERATOR_BIN",
        path.display()
    );
    Ok(path)
}
