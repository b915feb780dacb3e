//! A TCP proxy on a random loopback port in front of a broker, which can cut every connection
//! through it at once: the worker sees its socket reset in the middle of whatever it was doing
//! (a receive, an acknowledgement, a dead-letter publish) and must reconnect without losing or
//! duplicating anything.
//!
//! A holding proxy ([`CuttingProxy::holding`]) also watches what clients send: from the given
//! occurrence of a request on (a [`Hold`]), nothing a client sends reaches the server any more,
//! on any connection, while the server's answers still reach the clients. A test kills its
//! client there, knowing exactly which requests the server saw.
//!
//! A misdirecting proxy ([`CuttingProxy::misdirecting_commits`]) sends a Kafka client's
//! `OffsetCommit` requests for another group while [`CuttingProxy::misdirect`] is on: from
//! `OffsetCommit` v9 the broker refuses them with `GROUP_ID_NOT_FOUND`, which, like the
//! `REBALANCE_IN_PROGRESS` a commit sent during a rebalance gets, does not end the client's
//! membership: the client must commit again. (Before v9 the broker answers
//! `ILLEGAL_GENERATION`, on which librdkafka gives up its assignment and joins again.)
//!
//! A server that tells its clients where to connect next (Kafka's advertised listeners) must
//! know the proxy's port before it starts: its fixture declares a [`route`] for its address,
//! and the proxy started for that address listens on the route's port and forwards where the
//! route says (a listener that advertises the proxy).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
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

/// A request a client sends, as the proxy recognises it in the bytes of a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// These bytes, wherever they are (a RESP command, a NATS subject, an AMQP method's class
    /// and method ids, an HTTP request line).
    Bytes(Vec<u8>),
    /// A Kafka request with this API key (`DeleteRecords` is 21): requests are read as Kafka
    /// frames them, each a size and then the header, whose first field is the key.
    Kafka(i16),
}

/// Where a holding proxy starts holding: at the `occurrence`th `request` (counted from 1
/// over every connection), which the server never receives, nor anything sent after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    pub request: Request,
    pub occurrence: usize,
}

/// What a proxy does to what clients send, besides forwarding it.
#[derive(Debug, Clone)]
enum Watch {
    /// Stops forwarding at a request.
    Hold(Arc<Holding>),
    /// While on, sends Kafka `OffsetCommit` requests for another group.
    MisdirectCommits(Arc<AtomicBool>),
}

/// A [`Hold`] and how far the connections got.
#[derive(Debug)]
struct Holding {
    hold: Hold,
    /// The requests seen so far.
    seen: AtomicUsize,
    held: AtomicBool,
}

/// Forwards every connection to `upstream`; [`CuttingProxy::cut`] resets them all.
#[derive(Debug)]
pub struct CuttingProxy {
    address: SocketAddr,
    generation: watch::Sender<u64>,
    connections: Arc<AtomicU64>,
    /// Connections that were open when a cut reset them.
    severed: Arc<AtomicU64>,
    watch: Option<Watch>,
    accept: JoinHandle<()>,
}

impl CuttingProxy {
    /// Listens on a random loopback port and forwards to `upstream` (`host:port`), or as the
    /// [`route`] declared for `upstream` says.
    pub async fn start(upstream: &str) -> Result<Self> {
        Self::listen(upstream, None).await
    }

    /// [`CuttingProxy::start`], holding what clients send from `hold` on.
    pub async fn holding(upstream: &str, hold: Hold) -> Result<Self> {
        let holding = Holding {
            hold,
            seen: AtomicUsize::new(0),
            held: AtomicBool::new(false),
        };
        Self::listen(upstream, Some(Watch::Hold(Arc::new(holding)))).await
    }

    /// [`CuttingProxy::start`] for a Kafka node, sending `OffsetCommit` requests for another
    /// group while [`CuttingProxy::misdirect`] is on (it is off at first).
    pub async fn misdirecting_commits(upstream: &str) -> Result<Self> {
        let on = Arc::new(AtomicBool::new(false));
        Self::listen(upstream, Some(Watch::MisdirectCommits(on))).await
    }

    async fn listen(upstream: &str, watch: Option<Watch>) -> Result<Self> {
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
            let watch = watch.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    connections.fetch_add(1, Ordering::Relaxed);
                    let cut = generation.subscribe();
                    let ends = Ends {
                        upstream: upstream.clone(),
                        severed: severed.clone(),
                        watch: watch.clone(),
                    };
                    tokio::spawn(forward(client, ends, cut));
                }
            }
        });
        Ok(Self {
            address,
            generation,
            connections,
            severed,
            watch,
            accept,
        })
    }

    /// Whether a holding proxy holds now (its [`Hold`]'s request was sent).
    pub fn held(&self) -> bool {
        matches!(&self.watch, Some(Watch::Hold(holding)) if holding.held.load(Ordering::SeqCst))
    }

    /// Whether a misdirecting proxy sends the `OffsetCommit` requests it forwards from now on
    /// for another group.
    pub fn misdirect(&self, on: bool) {
        if let Some(Watch::MisdirectCommits(misdirecting)) = &self.watch {
            misdirecting.store(on, Ordering::SeqCst);
        }
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

/// Where a connection goes, and what the proxy counts and does to what clients send.
struct Ends {
    upstream: String,
    severed: Arc<AtomicU64>,
    watch: Option<Watch>,
}

/// Copies both ways until either side closes or the proxy cuts; a cut resets the client's
/// socket (SO_LINGER 0) so it sees a connection reset, not a clean close. A holding proxy
/// stops forwarding what the client sends once it holds.
async fn forward(mut client: TcpStream, ends: Ends, mut cut: watch::Receiver<u64>) {
    let Ok(mut server) = TcpStream::connect(&ends.upstream)
        .await
        .with_context(|| format!("connecting to {}", ends.upstream))
    else {
        return;
    };
    tokio::select! {
        _ = relay(&mut client, &mut server, ends.watch.as_ref()) => {
            let _ = client.shutdown().await;
        }
        _ = cut.changed() => {
            ends.severed.fetch_add(1, Ordering::Relaxed);
            for socket in [&client, &server] {
                let _ = socket2::SockRef::from(socket).set_linger(Some(std::time::Duration::ZERO));
            }
        }
    }
}

/// Until either side closes: both ways, or the server's way and the client's watched.
async fn relay(client: &mut TcpStream, server: &mut TcpStream, watch: Option<&Watch>) {
    let Some(watch) = watch else {
        let _ = tokio::io::copy_bidirectional(client, server).await;
        return;
    };
    let (mut from_client, mut to_client) = client.split();
    let (mut from_server, mut to_server) = server.split();
    let watched = async {
        match watch {
            Watch::Hold(holding) => {
                pass_requests(&mut from_client, &mut to_server, hold(holding)).await
            }
            Watch::MisdirectCommits(on) => {
                pass_requests(&mut from_client, &mut to_server, misdirect_commits(on)).await
            }
        }
    };
    tokio::select! {
        _ = tokio::io::copy(&mut from_server, &mut to_client) => {}
        _ = watched => {}
    }
}

/// Reads what the client sends until it closes, and forwards what `pass` makes of each read.
async fn pass_requests(
    from_client: &mut (impl tokio::io::AsyncRead + Unpin),
    to_server: &mut (impl tokio::io::AsyncWrite + Unpin),
    mut pass: impl FnMut(&[u8]) -> Vec<u8>,
) {
    let mut chunk = vec![0; 64 * 1024];
    while let Ok(read) = from_client.read(&mut chunk).await {
        if read == 0 {
            return;
        }
        let forward = pass(&chunk[..read]);
        if to_server.write_all(&forward).await.is_err() {
            return;
        }
    }
}

/// What to forward of each read: everything until the hold's request, nothing from there.
fn hold(holding: &Holding) -> impl FnMut(&[u8]) -> Vec<u8> + '_ {
    let mut sent = Scanner::default();
    move |read| {
        if holding.held.load(Ordering::SeqCst) {
            return Vec::new();
        }
        let forwarded = sent.bytes.len();
        sent.bytes.extend_from_slice(read);
        let mut until = sent.bytes.len();
        while let Some(at) = sent.next(&holding.hold.request) {
            if holding.seen.fetch_add(1, Ordering::SeqCst) + 1 >= holding.hold.occurrence {
                until = at.max(forwarded);
                break;
            }
        }
        if until < sent.bytes.len() {
            holding.held.store(true, Ordering::SeqCst);
        }
        sent.bytes[forwarded..until].to_vec()
    }
}

/// What to forward of each read of a Kafka client: its complete requests, each `OffsetCommit`
/// for another group while `on`.
fn misdirect_commits(on: &AtomicBool) -> impl FnMut(&[u8]) -> Vec<u8> + '_ {
    let mut sent = Vec::new();
    move |read| {
        sent.extend_from_slice(read);
        let mut complete = 0;
        while let Some(size) = sent.get(complete..complete + 4) {
            let end =
                complete + 4 + u32::from_be_bytes([size[0], size[1], size[2], size[3]]) as usize;
            if end > sent.len() {
                break;
            }
            if on.load(Ordering::SeqCst) {
                misdirect(&mut sent[complete + 4..end]);
            }
            complete = end;
        }
        sent.drain(..complete).collect()
    }
}

/// Changes the first byte of the group id of `request` (a Kafka request's header and body)
/// if it is an `OffsetCommit` (API key 8): the broker takes it for another group's.
fn misdirect(request: &mut [u8]) {
    if request.get(..2) == Some(&8i16.to_be_bytes()[..])
        && let Some(at) = group_id_at(request)
    {
        request[at] ^= 1;
    }
}

/// Where the group id of an `OffsetCommit` `request` starts: past the header (API key,
/// version, correlation id, client id, and from version 8 tagged fields) and the id's length
/// (a compact string's varint from version 8, two bytes before).
fn group_id_at(request: &[u8]) -> Option<usize> {
    let version = i16::from_be_bytes([*request.get(2)?, *request.get(3)?]);
    let client_id = i16::from_be_bytes([*request.get(8)?, *request.get(9)?]);
    let mut at = 10 + usize::try_from(client_id).unwrap_or(0);
    if version >= 8 {
        for _ in 0..uvarint(request, &mut at)? {
            uvarint(request, &mut at)?;
            let size = uvarint(request, &mut at)?;
            at += usize::try_from(size).ok()?;
        }
        uvarint(request, &mut at)?;
    } else {
        at += 2;
    }
    (at < request.len()).then_some(at)
}

/// The unsigned varint at `bytes[*at..]`; `at` moves past it.
fn uvarint(bytes: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for (index, byte) in bytes.get(*at..)?.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * index);
        if byte & 0x80 == 0 {
            *at += index + 1;
            return Some(value);
        }
    }
    None
}

/// What a client sent on one connection, and how far it was searched.
#[derive(Default)]
struct Scanner {
    bytes: Vec<u8>,
    /// Where the search goes on: past the last match, or the next Kafka request.
    from: usize,
}

impl Scanner {
    /// Where the next `request` starts, if it was sent.
    fn next(&mut self, request: &Request) -> Option<usize> {
        match request {
            Request::Bytes(pattern) => {
                let found = self.bytes[self.from..]
                    .windows(pattern.len())
                    .position(|window| window == pattern.as_slice())
                    .map(|at| self.from + at);
                self.from = match found {
                    Some(at) => at + pattern.len(),
                    None => self
                        .bytes
                        .len()
                        .saturating_sub(pattern.len() - 1)
                        .max(self.from),
                };
                found
            }
            Request::Kafka(key) => {
                while let Some(header) = self.bytes.get(self.from..self.from + 6) {
                    let at = self.from;
                    let size = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
                    self.from = at + 4 + size as usize;
                    if i16::from_be_bytes([header[4], header[5]]) == *key {
                        return Some(at);
                    }
                }
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_split_between_two_reads_are_found_once_where_they_start() {
        let exec = Request::Bytes(b"$4\r\nEXEC\r\n".to_vec());
        let mut sent = Scanner::default();
        sent.bytes.extend_from_slice(b"*1\r\n$4\r\nEX");
        assert_eq!(sent.next(&exec), None);
        sent.bytes.extend_from_slice(b"EC\r\n*1\r\n$5\r\nMULTI\r\n");
        assert_eq!(sent.next(&exec), Some(4));
        assert_eq!(sent.next(&exec), None);
    }

    /// A Kafka request: its size, then API key, version, correlation id and `rest`.
    fn kafka_request(key: i16, rest: &[u8]) -> Vec<u8> {
        let mut request = (8 + rest.len() as u32).to_be_bytes().to_vec();
        request.extend_from_slice(&key.to_be_bytes());
        request.extend_from_slice(&[0, 1, 0, 0, 0, 21]);
        request.extend_from_slice(rest);
        request
    }

    #[test]
    fn an_offset_commit_is_sent_for_another_group_and_nothing_else_is_changed() {
        // OffsetCommit v9: client id "w1", one tagged field in the header, group "g1".
        let mut commit = vec![
            0, 8, 0, 9, 0, 0, 0, 7, 0, 2, b'w', b'1', 1, 5, 2, 0xaa, 0xbb,
        ];
        commit.extend_from_slice(&[3, b'g', b'1', 0, 0, 0, 4]);
        let mut misdirected = commit.clone();
        misdirect(&mut misdirected);
        assert_eq!(misdirected[..17], commit[..17]);
        assert_eq!(misdirected[17..], [3, b'f', b'1', 0, 0, 0, 4]);
        // Version 7: no tagged fields, a two-byte length.
        let mut old = vec![0, 8, 0, 7, 0, 0, 0, 7, 0xff, 0xff, 0, 2, b'g', b'1'];
        misdirect(&mut old);
        assert_eq!(old[12..], [b'f', b'1']);
        let mut fetch = vec![0, 1, 0, 9, 0, 0, 0, 7, 0, 0, 0, 3, b'g', b'1'];
        let unchanged = fetch.clone();
        misdirect(&mut fetch);
        assert_eq!(fetch, unchanged);
    }

    #[test]
    fn a_kafka_request_is_found_by_its_key_not_by_its_bytes_elsewhere() {
        let delete_records = Request::Kafka(21);
        let mut sent = Scanner::default();
        // A produce whose correlation id and records hold the key's bytes.
        let produce = kafka_request(0, &[0, 21, 0, 21]);
        sent.bytes.extend_from_slice(&produce);
        let deletion = kafka_request(21, b"dlq");
        sent.bytes.extend_from_slice(&deletion[..5]);
        assert_eq!(sent.next(&delete_records), None);
        sent.bytes.extend_from_slice(&deletion[5..]);
        assert_eq!(sent.next(&delete_records), Some(produce.len()));
        assert_eq!(sent.next(&delete_records), None);
    }
}
