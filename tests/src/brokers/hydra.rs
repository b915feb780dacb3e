//! A real OAuth2 server: Ory Hydra, in memory, as a child process on random loopback ports,
//! issuing JWT access tokens (RS256, JWKS at `/.well-known/jwks.json`) to client-credentials
//! clients. Its request log counts the calls of the token endpoint.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use nix::sys::signal::Signal;
use tempfile::TempDir;

use crate::servers::{free_ports, http_get, http_post_json, stop_child};
use crate::wait::wait_until;

/// The Hydra version `scripts/hydra.sh` builds and this harness looks for.
pub const HYDRA_VERSION: &str = "2.3.0";

const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
const LOG_FILE: &str = "hydra.log";

/// A client-credentials client of the server.
#[derive(Clone)]
pub struct OAuthClient {
    pub id: String,
    pub secret: String,
}

impl std::fmt::Debug for OAuthClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OAuthClient").field("id", &self.id).finish()
    }
}

/// A Hydra server of our own.
#[derive(Debug)]
pub struct Hydra {
    dir: TempDir,
    public_port: u16,
    admin_port: u16,
    child: Option<Child>,
}

impl Hydra {
    /// Starts a server whose access tokens live `token_lifetime`, waiting until it is ready.
    /// Fails when Hydra is not built (`make hydra`). A port taken by another process between
    /// being picked and being bound is picked again (up to three tries).
    pub fn start(token_lifetime: Duration) -> Result<Self> {
        let mut tries = 1;
        loop {
            match Self::start_once(token_lifetime) {
                Err(err) if tries < 3 && format!("{err:#}").contains("address already in use") => {
                    tries += 1;
                }
                started => return started,
            }
        }
    }

    fn start_once(token_lifetime: Duration) -> Result<Self> {
        let binary = binary()?;
        let dir = tempfile::Builder::new()
            .prefix("switchboard-hydra-")
            .tempdir()?;
        let [public_port, admin_port] = free_ports()?;
        let log = File::create(dir.path().join(LOG_FILE))?;
        let mut child = Command::new(binary)
            .args(["serve", "all", "--dev"])
            .env("DSN", "memory")
            .env("SECRETS_SYSTEM", "switchboard-tests-system-secret")
            .env("SERVE_PUBLIC_HOST", "127.0.0.1")
            .env("SERVE_PUBLIC_PORT", public_port.to_string())
            .env("SERVE_ADMIN_HOST", "127.0.0.1")
            .env("SERVE_ADMIN_PORT", admin_port.to_string())
            .env(
                "URLS_SELF_ISSUER",
                format!("http://127.0.0.1:{public_port}/"),
            )
            .env("STRATEGIES_ACCESS_TOKEN", "jwt")
            .env(
                "TTL_ACCESS_TOKEN",
                format!("{}s", token_lifetime.as_secs().max(1)),
            )
            .env("LOG_LEVEL", "info")
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting hydra")?;
        let ready = wait_until(STARTUP_TIMEOUT, "Hydra reports ready", || {
            matches!(http_get(admin_port, "/health/ready"), Ok((200, _)))
                || matches!(child.try_wait(), Ok(Some(_)))
        });
        let exited = child.try_wait().ok().flatten();
        if ready.is_err() || exited.is_some() {
            stop_child(&mut child, Signal::SIGKILL, STOP_TIMEOUT);
            let log = std::fs::read_to_string(dir.path().join(LOG_FILE)).unwrap_or_default();
            bail!("Hydra did not start ({exited:?}); its log:\n{log}");
        }
        Ok(Self {
            dir,
            public_port,
            admin_port,
            child: Some(child),
        })
    }

    /// `http://127.0.0.1:PORT/oauth2/token`.
    pub fn token_url(&self) -> String {
        format!("http://127.0.0.1:{}/oauth2/token", self.public_port)
    }

    /// The public port, serving the token endpoint and the JWKS.
    pub fn public_port(&self) -> u16 {
        self.public_port
    }

    /// Creates a client-credentials client allowed `audience` and `scopes`
    /// (`client_secret_post`: the secret goes in the form body).
    pub fn create_client(&self, audience: &str, scopes: &[&str]) -> Result<OAuthClient> {
        let body = serde_json::json!({
            "grant_types": ["client_credentials"],
            "audience": [audience],
            "scope": scopes.join(" "),
            "token_endpoint_auth_method": "client_secret_post",
        })
        .to_string();
        let (status, answer) = http_post_json(self.admin_port, "/admin/clients", &body)?;
        ensure!(status == 201, "Hydra refused the client: {status} {answer}");
        let client: serde_json::Value = serde_json::from_str(&answer)?;
        let field = |name: &str| {
            client[name]
                .as_str()
                .map(str::to_owned)
                .with_context(|| format!("Hydra's client has no {name}"))
        };
        Ok(OAuthClient {
            id: field("client_id")?,
            secret: field("client_secret")?,
        })
    }

    /// How many token requests the server has answered so far (from its request log).
    pub fn token_requests(&self) -> Result<usize> {
        let log = std::fs::read_to_string(self.dir.path().join(LOG_FILE))?;
        Ok(log
            .lines()
            .filter(|line| {
                line.contains("msg=completed handling request")
                    && line.contains("method:POST path:/oauth2/token ")
            })
            .count())
    }
}

impl Drop for Hydra {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            stop_child(&mut child, Signal::SIGTERM, STOP_TIMEOUT);
        }
    }
}

/// `$HYDRA_BIN`, else the binary `scripts/hydra.sh` builds into the cache.
fn binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("HYDRA_BIN").filter(|v| !v.is_empty()) {
        return Ok(path.into());
    }
    let path = super::cache_dir()?
        .join(format!("hydra-{HYDRA_VERSION}"))
        .join("bin/hydra");
    ensure!(
        path.is_file(),
        "Ory Hydra {HYDRA_VERSION} is not built in {}: run `make hydra` (or `scripts/hydra.sh`), \
         or set HYDRA_BIN to a hydra binary",
        path.display()
    );
    Ok(path)
}
