//! A TCP proxy on a random loopback port in front of a broker, which can cut every connection
//! through it at once: the worker sees its socket reset in the middle of whatever it was doing
//! (a receive, an acknowledgement, a dead-letter publish) and must reconnect without losing or
//! duplicating anything.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};
use tokio::io::AsyncWriteExt as _;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Forwards every connection to `upstream`; [`CuttingProxy::cut`] resets them all.
#[derive(Debug)]
pub struct CuttingProxy {
    address: SocketAddr,
    generation: watch::Sender<u64>,
    connections: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl CuttingProxy {
    /// Listens on a random loopback port and forwards to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let upstream = upstream.to_owned();
        let (generation, _) = watch::channel(0u64);
        let connections = Arc::new(AtomicU64::new(0));
        let accept = tokio::spawn({
            let generation = generation.clone();
            let connections = connections.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    connections.fetch_add(1, Ordering::Relaxed);
                    let cut = generation.subscribe();
                    tokio::spawn(forward(client, upstream.clone(), cut));
                }
            }
        });
        Ok(Self {
            address,
            generation,
            connections,
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
}

impl Drop for CuttingProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// Copies both ways until either side closes or the proxy cuts; a cut resets the client's
/// socket (SO_LINGER 0) so it sees a connection reset, not a clean close.
async fn forward(mut client: TcpStream, upstream: String, mut cut: watch::Receiver<u64>) {
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
            for socket in [&client, &server] {
                let _ = socket2::SockRef::from(socket).set_linger(Some(std::time::Duration::ZERO));
            }
        }
    }
}
