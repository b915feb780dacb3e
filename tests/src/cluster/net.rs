//! The cluster's network namespace and the loopback forwards across its border.
//!
//! Everything of the cluster's networking — the node address, the CNI bridge, the pods' veths,
//! the Service addresses and kube-proxy's iptables rules — exists only in a network namespace of
//! its own (`ip netns add`). The host reaches in only through [`Forward`]s: a listener on the
//! host's 127.0.0.1 whose connections are opened from a thread that entered the namespace (a
//! socket keeps the namespace it was created in), and the reverse for pods reaching a server of
//! the test on the host's loopback.

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};
use nix::sched::{CloneFlags, setns};

/// A network namespace `/run/netns/<name>`, deleted on drop.
#[derive(Debug)]
pub struct Netns {
    pub name: String,
}

fn ip(args: &[&str]) -> Result<()> {
    super::run(Command::new("ip").args(args))?;
    Ok(())
}

impl Netns {
    /// Creates namespace `name` with its loopback up and a bridge `bridge` holding `address`
    /// (`10.x.y.z/24`): the node's address, and the pods' gateway once the CNI plugin attaches
    /// their veths to the bridge.
    pub fn create(name: &str, bridge: &str, address: &str) -> Result<Self> {
        ip(&["netns", "add", name])?;
        let netns = Self {
            name: name.to_owned(),
        };
        for args in [
            vec!["link", "set", "lo", "up"],
            vec!["link", "add", bridge, "type", "bridge"],
            vec!["addr", "add", address, "dev", bridge],
            vec!["link", "set", bridge, "up"],
        ] {
            ip(&[&["-n", name], args.as_slice()].concat())?;
        }
        Ok(netns)
    }

    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// The namespace, for [`in_netns`].
    fn open(&self) -> Result<Arc<File>> {
        Ok(Arc::new(File::open(self.path()).with_context(|| {
            format!("opening {}", self.path().display())
        })?))
    }

    /// Runs `f` on a new thread that entered the namespace: sockets it creates live there.
    pub fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
    ) -> Result<T> {
        in_netns(&self.open()?, f).context("in the cluster's network namespace")
    }

    /// `nsenter --net=…`: the prefix of a command that runs in the namespace (only its network;
    /// unlike `ip netns exec` it keeps the host's /sys and its cgroup mounts).
    pub fn command(&self, program: &std::path::Path) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.path().display()))
            .arg("--")
            .arg(program);
        cmd
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["netns", "delete", &self.name]);
    }
}

/// A TCP forward: connections to `listen` are piped to the target. Stops on drop.
#[derive(Debug)]
pub struct Forward {
    pub listen: SocketAddr,
    stop: Arc<AtomicBool>,
    /// The namespace of the listener, when it is not the host's.
    netns: Option<Arc<File>>,
}

/// Runs `f` on a new thread that entered the network namespace of `netns`.
fn in_netns<T: Send + 'static>(
    netns: &Arc<File>,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let netns = Arc::clone(netns);
    std::thread::spawn(move || {
        setns(&*netns, CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
        f()
    })
    .join()
    .map_err(|_| std::io::Error::other("the namespace thread panicked"))?
}

impl Forward {
    /// Host `127.0.0.1:<random port>` → `target` in the namespace.
    pub fn into_netns(netns: &Netns, target: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let file = netns.open()?;
        Self::start(listener, None, move || {
            in_netns(&file, move || TcpStream::connect(target))
        })
    }

    /// `listen` in the namespace (port 0: a free one) → `target` on the host.
    pub fn out_of_netns(netns: &Netns, listen: SocketAddr, target: SocketAddr) -> Result<Self> {
        let file = netns.open()?;
        let listener = in_netns(&file, move || TcpListener::bind(listen))?;
        Self::start(listener, Some(file), move || TcpStream::connect(target))
    }

    fn start(
        listener: TcpListener,
        netns: Option<Arc<File>>,
        connect: impl Fn() -> std::io::Result<TcpStream> + Send + 'static,
    ) -> Result<Self> {
        let listen = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if stopped.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = client else { continue };
                match connect() {
                    Ok(server) => pipe(client, server),
                    Err(_) => drop(client),
                }
            }
        });
        Ok(Self {
            listen,
            stop,
            netns,
        })
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accepting thread with a connection from the listener's namespace.
        let listen = self.listen;
        let _ = match &self.netns {
            Some(netns) => in_netns(netns, move || TcpStream::connect(listen)).map(drop),
            None => TcpStream::connect(listen).map(drop),
        };
    }
}

/// Copies both ways until each side has closed.
fn pipe(a: TcpStream, b: TcpStream) {
    let halves = a.try_clone().and_then(|a2| Ok((a2, b.try_clone()?)));
    let Ok((a2, b2)) = halves else { return };
    std::thread::spawn(move || copy(a, b));
    std::thread::spawn(move || copy(b2, a2));
}

fn copy(mut from: TcpStream, mut to: TcpStream) {
    let mut buffer = [0u8; 16 * 1024];
    loop {
        match from.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => {
                if to.write_all(&buffer[..n]).is_err() {
                    break;
                }
            }
            Err(err) if err.kind() == ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}
