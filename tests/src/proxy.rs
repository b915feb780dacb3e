//! A TCP proxy on a random loopback port in front of a broker, which can cut every connection
//! through it at once: the worker sees its socket reset in the middle of whatever it was doing
//! (a receive, an acknowledgement, a dead-letter publish) and must reconnect without losing or
//! duplicating anything.
//!
//! A server that tells its clients where to connect next (Kafka's advertised listeners) must
//! know the proxy's port before it starts: its fixture declares a [`route`] for its address,
//! and the proxy started for that address listens on the route's port and forwards where the
//! route says (a listener that advertises the proxy).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{Context, Result};
use tokio::io::AsyncWriteExt as _;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Where the proxy for a server's address listens, and where it forwards.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Route {
    port: u16,
    forward_to: String,
}

static ROUTES: Mutex<Option<HashMap<String, Route>>> = Mutex::new(None);

/// The proxy started for `address` will listen on loopback port `port` (reserved by the
/// caller, which has told its server to send clients there) and forward to `forward_to`.
pub fn route(address: &str, port: u16, forward_to: &str) {
    ROUTES
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_or_insert_with(HashMap::new)
        .insert(
            address.to_owned(),
            Route {
                port,
                forward_to: forward_to.to_owned(),
            },
        );
}

/// Forwards every connection to `upstream`; [`CuttingProxy::cut`] resets them all.
#[derive(Debug)]
pub struct CuttingProxy {
    address: SocketAddr,
    generation: watch::Sender<u64>,
    connections: Arc<AtomicU64>,
    /// Connections that were open when a cut reset them.
    severed: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl CuttingProxy {
    /// Listens on a random loopback port and forwards to `upstream` (`host:port`), or as the
    /// [`route`] declared for `upstream` says.
    pub async fn start(upstream: &str) -> Result<Self> {
        let route = ROUTES
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(|routes| routes.get(upstream).cloned());
        let (port, upstream) = match route {
            Some(Route { port, forward_to }) => (port, forward_to),
            None => (0, upstream.to_owned()),
        };
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .with_context(|| format!("binding the proxy to port {port}"))?;
        let address = listener.local_addr()?;
        let (generation, _) = watch::channel(0u64);
        let connections = Arc::new(AtomicU64::new(0));
        let severed = Arc::new(AtomicU64::new(0));
        let accept = tokio::spawn({
            let generation = generation.clone();
            let connections = connections.clone();
            let severed = severed.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    connections.fetch_add(1, Ordering::Relaxed);
                    let cut = generation.subscribe();
                    tokio::spawn(forward(client, upstream.clone(), cut, severed.clone()));
                }
            }
        });
        Ok(Self {
            address,
            generation,
            connections,
            severed,
            accept,
        })
    }

    /// `127.0.0.1:PORT`, where clients connect.
    pub fn address(&self) -> String {
        self.address.to_string()
    }

    /// Resets every connection open through the proxy now (new ones are accepted).
    pub fn cut(&self) {
        self.generation.send_modify(|generation| *generation += 1);
    }

    /// How many connections clients opened through the proxy so far.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    /// How many open connections the cuts reset so far.
    pub fn severed(&self) -> u64 {
        self.severed.load(Ordering::Relaxed)
    }
}

impl Drop for CuttingProxy {
    fn drop(&mut self) {
        self.accept.abort();
        eprintln!(
            "proxy {}: {} connections opened, {} reset by {} cuts",
            self.address,
            self.connections(),
            self.severed(),
            *self.generation.borrow()
        );
        self.cut();
    }
}

/// Copies both ways until either side closes or the proxy cuts; a cut resets the client's
/// socket (SO_LINGER 0) so it sees a connection reset, not a clean close.
async fn forward(
    mut client: TcpStream,
    upstream: String,
    mut cut: watch::Receiver<u64>,
    severed: Arc<AtomicU64>,
) {
    let Ok(mut server) = TcpStream::connect(&upstream)
        .await
        .with_context(|| format!("connecting to {upstream}"))
    else {
        return;
    };
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {
            let _ = client.shutdown().await;
        }
        _ = cut.changed() => {
            severed.fetch_add(1, Ordering::Relaxed);
            for socket in [&client, &server] {
                let _ = socket2::SockRef::from(socket).set_linger(Some(std::time::Duration::ZERO));
            }
        }
    }
}
