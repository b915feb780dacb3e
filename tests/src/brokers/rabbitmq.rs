//! A real RabbitMQ node (Debian's `rabbitmq-server` 3.10) as a child process on random loopback
//! ports, and a lapin client with helpers to declare queues, publish and inspect them.
//!
//! The recipe (docs/brokers.md): our own `epmd` on a free port (else erl starts a detached one
//! that leaks), `RABBITMQ_DIST_PORT` always set (the default NODE_PORT+20000 overflows for high
//! ports), `HOME` = the node's directory (the Erlang cookie), and
//! `/usr/lib/rabbitmq/bin/rabbitmq-server` run directly. It is stopped with SIGTERM to the
//! wrapper shell, which stops beam.smp; SIGKILL of the wrapper would orphan beam.smp, so the
//! node runs in its own process group and only a node that ignores SIGTERM for 30 s gets a
//! SIGKILL, to the whole group.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPHardError};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use tempfile::TempDir;

use super::BrokerFixture;
use crate::Fixture;
use crate::servers::{children_of, free_ports, stop_child};
use crate::wait::wait_until;

/// The RabbitMQ version Debian bookworm ships, which the harness was proven with.
pub const RABBITMQ_VERSION: &str = "3.10";
const SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";
const CTL: &str = "/usr/lib/rabbitmq/bin/rabbitmqctl";
const INSTALL: &str =
    "install it with `make deps` (apt-get install -y --no-install-recommends rabbitmq-server)";
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// A queue's type, as the worker and the tests declare it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueType {
    Quorum,
    Classic,
}

impl QueueType {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        }
    }
}

/// Queue arguments: `x-queue-type` and more.
pub fn queue_arguments(queue_type: QueueType, more: &[(&str, AMQPValue)]) -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert("x-queue-type".into(), text(queue_type.as_str()));
    for (name, value) in more {
        arguments.insert((*name).into(), value.clone());
    }
    arguments
}

/// A string header or argument value.
pub fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.as_bytes().to_vec()))
}

/// A RabbitMQ node of our own, with its own epmd, in a temporary directory.
#[derive(Debug)]
pub struct RabbitMq {
    dir: TempDir,
    amqp_port: u16,
    dist_port: u16,
    epmd_port: u16,
    epmd: Option<Child>,
    node: Option<Child>,
    /// The management plugin's HTTP port, when started with it.
    management_port: Option<u16>,
}

impl RabbitMq {
    /// Starts epmd and the node, waiting until the node accepts AMQP connections. Fails when
    /// `rabbitmq-server` is not installed.
    pub fn start() -> Result<Self> {
        Self::start_with(false)
    }

    /// [`RabbitMq::start`] with the management plugin (its HTTP API, which KEDA's `rabbitmq`
    /// trigger reads) on a loopback port of its own, its statistics collected every second;
    /// waits until the API answers too.
    pub fn start_managed() -> Result<Self> {
        Self::start_with(true)
    }

    fn start_with(management: bool) -> Result<Self> {
        ensure!(
            Path::new(SERVER).exists(),
            "RabbitMQ is not installed ({SERVER} is missing): {INSTALL}"
        );
        let dir = tempfile::Builder::new()
            .prefix("switchboard-rabbitmq-")
            .tempdir()?;
        let plugins = if management {
            "[rabbitmq_management].\n"
        } else {
            "[].\n"
        };
        std::fs::write(dir.path().join("enabled_plugins"), plugins)?;
        // Quorum queues publish their message counts (what `rabbitmqctl list_queues` reports)
        // on a tick, every 5 s by default: often enough for tests to wait on them.
        std::fs::write(
            dir.path().join("advanced.config"),
            "[{rabbit, [{quorum_tick_interval, 100}]}].\n",
        )?;
        let [amqp_port, epmd_port, dist_port, http_port] = free_ports()?;
        let management_port = management.then_some(http_port);
        let mut conf = format!("listeners.tcp.default = 127.0.0.1:{amqp_port}\n");
        if let Some(port) = management_port {
            conf.push_str(&format!(
                "management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {port}\n\
                 collect_statistics_interval = 1000\n"
            ));
        }
        std::fs::write(dir.path().join("rabbitmq.conf"), conf)?;
        let epmd = Command::new("epmd")
            .args(["-port", &epmd_port.to_string(), "-address", "127.0.0.1"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting epmd (it comes with rabbitmq-server): {INSTALL}"))?;
        let mut server = Self {
            dir,
            amqp_port,
            dist_port,
            epmd_port,
            epmd: Some(epmd),
            node: None,
            management_port,
        };
        wait_until(Duration::from_secs(10), "epmd accepts connections", || {
            std::net::TcpStream::connect(("127.0.0.1", epmd_port)).is_ok()
        })?;
        server.start_node()?;
        if let Some(port) = management_port {
            wait_until(STARTUP_TIMEOUT, "RabbitMQ's management API answers", || {
                std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            })?;
        }
        Ok(server)
    }

    /// `http://guest:guest@127.0.0.1:PORT/` of the management API, when started with it
    /// ([`RabbitMq::start_managed`]).
    pub fn management_url(&self) -> Option<String> {
        self.management_port
            .map(|port| format!("http://guest:guest@127.0.0.1:{port}/"))
    }

    fn node_name(&self) -> String {
        format!("rabbit-{}@localhost", self.amqp_port)
    }

    /// Starts the node (again, after [`RabbitMq::stop`]) with the same data directory and
    /// ports, waiting until it accepts AMQP connections.
    pub fn start_node(&mut self) -> Result<()> {
        use std::os::unix::process::CommandExt as _;
        let d = self.dir.path();
        // Appended across restarts: what the node said before a crash stays readable.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(d.join("stdout.log"))?;
        let node = Command::new(SERVER)
            .env("HOME", d)
            .env("ERL_EPMD_PORT", self.epmd_port.to_string())
            .env("ERL_EPMD_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODENAME", self.node_name())
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.amqp_port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_CONF_ENV_FILE", "/dev/null")
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq.conf"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", d.join("advanced.config"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("enabled_plugins"))
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_PID_FILE", d.join("rabbit.pid"))
            .env("RABBITMQ_LOGS", "-")
            .env(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-kernel inet_dist_use_interface {127,0,0,1}",
            )
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {SERVER}"))?;
        self.node = Some(node);
        let port = self.amqp_port;
        let ready = wait_until(STARTUP_TIMEOUT, "RabbitMQ accepts AMQP connections", || {
            let exited = self
                .node
                .as_mut()
                .is_none_or(|node| matches!(node.try_wait(), Ok(Some(_))));
            exited || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        let exited = self
            .node
            .as_mut()
            .is_none_or(|node| matches!(node.try_wait(), Ok(Some(_))));
        if ready.is_err() || exited {
            let log = std::fs::read_to_string(d.join("stdout.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!(
                "RabbitMQ did not start on 127.0.0.1:{port}:\n{}",
                tail.join("\n")
            );
        }
        Ok(())
    }

    /// The node's AMQP port on 127.0.0.1.
    pub fn amqp_port(&self) -> u16 {
        self.amqp_port
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2f`; the same across restarts.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.amqp_port)
    }

    /// The node's beam.smp process (the wrapper shell's child), for CPU accounting.
    pub fn pid(&self) -> Option<u32> {
        let wrapper = i32::try_from(self.node.as_ref()?.id()).ok()?;
        children_of(wrapper).into_iter().find_map(|pid| {
            let command = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            (command.trim() == "beam.smp").then(|| u32::try_from(pid).ok())?
        })
    }

    /// SIGTERM to the wrapper, which stops beam.smp (about 2 s); a node still running after
    /// 30 s is SIGKILLed with its whole process group, so beam.smp is never orphaned.
    pub fn stop(&mut self) {
        let Some(mut node) = self.node.take() else {
            return;
        };
        let Ok(pid) = i32::try_from(node.id()) else {
            return;
        };
        let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        let stopped = wait_until(STOP_TIMEOUT, "RabbitMQ stops", || {
            matches!(node.try_wait(), Ok(Some(_)))
        });
        if stopped.is_err() {
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
            let _ = node.wait();
        }
    }

    /// Stops the node and starts it again with the same data directory and ports: durable
    /// queues and persistent messages survive, connections are cut.
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        self.start_node()
    }

    /// SIGKILLs the node's whole process group (the wrapper shell and beam.smp, whatever they
    /// are doing) and starts it again with the same data directory and ports: what it
    /// confirmed survives.
    pub fn crash(&mut self) -> Result<()> {
        if let Some(mut node) = self.node.take() {
            let pid = i32::try_from(node.id())?;
            killpg(Pid::from_raw(pid), Signal::SIGKILL)?;
            node.wait()?;
            let beam_gone = wait_until(STOP_TIMEOUT, "beam.smp exits", || {
                std::net::TcpStream::connect(("127.0.0.1", self.amqp_port)).is_err()
            });
            beam_gone?;
        }
        self.start_node()
    }

    /// Runs `rabbitmqctl` against the node with `args`; fails unless it succeeds.
    pub async fn ctl(&self, args: &[&str]) -> Result<String> {
        let output = tokio::process::Command::new(CTL)
            .env("HOME", self.dir.path())
            .env("ERL_EPMD_PORT", self.epmd_port.to_string())
            .env("RABBITMQ_CONF_ENV_FILE", "/dev/null")
            .arg("-n")
            .arg(self.node_name())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .await
            .context("running rabbitmqctl")?;
        ensure!(
            output.status.success(),
            "rabbitmqctl {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// A new connection and channel in confirm mode.
    pub async fn channel(&self) -> Result<(Connection, Channel)> {
        let connection = Connection::connect(&self.url(), ConnectionProperties::default())
            .await
            .context("connecting to RabbitMQ")?;
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok((connection, channel))
    }

    /// Declares a durable queue with `arguments`.
    pub async fn declare(&self, name: &str, arguments: FieldTable) -> Result<()> {
        self.delete_and_declare(false, name, arguments).await
    }

    /// Deletes queue `name` and declares it again, empty, with `arguments`, on one channel
    /// (back to back: a consumer that reconnects finds it).
    pub async fn redeclare(&self, name: &str, arguments: FieldTable) -> Result<()> {
        self.delete_and_declare(true, name, arguments).await
    }

    /// [`Self::delete_and_declare_once`], again on a new connection when RabbitMQ answered
    /// INTERNAL_ERROR (541): a loaded node can fail to start a quorum queue's Raft members in
    /// time and refuses the declare so (seen in CI). Each attempt is printed.
    async fn delete_and_declare(
        &self,
        delete: bool,
        name: &str,
        arguments: FieldTable,
    ) -> Result<()> {
        const ATTEMPTS: usize = 3;
        for attempt in 1..ATTEMPTS {
            match self
                .delete_and_declare_once(delete, name, arguments.clone())
                .await
            {
                Err(err) if internal_error(&err) => {
                    println!("declaring queue {name}, attempt {attempt}: {err:#}; again");
                }
                outcome => return outcome,
            }
        }
        self.delete_and_declare_once(delete, name, arguments).await
    }

    async fn delete_and_declare_once(
        &self,
        delete: bool,
        name: &str,
        arguments: FieldTable,
    ) -> Result<()> {
        let (connection, channel) = self.channel().await?;
        if delete {
            channel
                .queue_delete(name.into(), QueueDeleteOptions::default())
                .await
                .with_context(|| format!("deleting queue {name}"))?;
        }
        let options = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .queue_declare(name.into(), options, arguments)
            .await
            .with_context(|| format!("declaring queue {name}"))?;
        let _ = connection.close(200, "done".into()).await;
        Ok(())
    }

    /// Deletes queue `name`.
    pub async fn delete(&self, name: &str) -> Result<()> {
        let (connection, channel) = self.channel().await?;
        channel
            .queue_delete(name.into(), QueueDeleteOptions::default())
            .await
            .with_context(|| format!("deleting queue {name}"))?;
        let _ = connection.close(200, "done".into()).await;
        Ok(())
    }

    /// Publishes each (body, properties) to queue `name` (the default exchange), persistent,
    /// and waits for every confirm.
    pub async fn publish(
        &self,
        name: &str,
        messages: impl IntoIterator<Item = (Vec<u8>, BasicProperties)>,
    ) -> Result<()> {
        let (connection, channel) = self.channel().await?;
        let mut confirms = Vec::new();
        for (body, properties) in messages {
            let properties = properties.with_delivery_mode(2);
            confirms.push(
                channel
                    .basic_publish(
                        "".into(),
                        name.into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        &body,
                        properties,
                    )
                    .await?,
            );
        }
        for confirm in confirms {
            match confirm.await? {
                Confirmation::Ack(None) => {}
                other => bail!("publish to {name} not confirmed: {other:?}"),
            }
        }
        let _ = connection.close(200, "done".into()).await;
        Ok(())
    }

    /// Messages of queue `name`, ready plus delivered and un-acknowledged, as the node counts
    /// them (`rabbitmqctl list_queues`; the passive declare only counts ready messages). For a
    /// quorum queue the count is at most one tick (100 ms here) old.
    pub async fn messages(&self, name: &str) -> Result<u64> {
        self.counted(name, "messages")
            .await?
            .with_context(|| format!("queue {name} not listed by rabbitmqctl"))
    }

    /// The `rabbitmqctl list_queues` column `column` (`messages`, `messages_unacknowledged`, …)
    /// of queue `name`; `None` when the node has no such queue.
    pub async fn counted(&self, name: &str, column: &str) -> Result<Option<u64>> {
        let listing = self
            .ctl(&[
                "list_queues",
                "--quiet",
                "--no-table-headers",
                "name",
                column,
            ])
            .await?;
        for line in listing.lines() {
            let mut columns = line.split('\t');
            if columns.next() == Some(name) {
                let count = columns.next().context("no count column")?;
                return count
                    .trim()
                    .parse()
                    .map(Some)
                    .with_context(|| format!("{column} of {name}: {count:?}"));
            }
        }
        Ok(None)
    }

    /// Every message of queue `name` (body, headers), read with `basic.get` on a channel that
    /// is then closed without acknowledging: the messages stay in the queue. A quorum queue
    /// whose Raft members are busy (after the node was killed, on a loaded machine) may answer
    /// a get with `INTERNAL_ERROR … timeout`: it is asked again until it answers, for a minute.
    /// One that still does not answer is read as empty only if the node counts no message in
    /// it; otherwise the error carries the node's log lines about the queue. (After a SIGKILL, a
    /// single node's quorum queue may stay without a leader: "leader call - leader not known",
    /// rabbitmq-server#10070, seen here on 3.10.8 for the chaos run's untouched `chaos.dlq`.)
    pub async fn peek(&self, name: &str) -> Result<Vec<(Vec<u8>, BasicProperties)>> {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            match self.peek_once(name).await {
                Err(err) if format!("{err:#}").contains("timeout") => {
                    if std::time::Instant::now() < deadline {
                        continue;
                    }
                    let log = self.log_lines_naming(name);
                    if self.counted(name, "messages").await.ok().flatten() == Some(0) {
                        println!(
                            "queue {name} answered no basic.get for 60 s; the node counts 0 \
                             messages in it. Its log about the queue:\n{log}"
                        );
                        return Ok(Vec::new());
                    }
                    return Err(err.context(format!("the node's log about {name}:\n{log}")));
                }
                done => return done,
            }
        }
    }

    /// The last 20 lines of the node's log that name `name`.
    fn log_lines_naming(&self, name: &str) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("stdout.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().filter(|line| line.contains(name)).collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    async fn peek_once(&self, name: &str) -> Result<Vec<(Vec<u8>, BasicProperties)>> {
        let connection = Connection::connect(&self.url(), ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        let mut messages = Vec::new();
        while let Some(message) = channel
            .basic_get(name.into(), BasicGetOptions::default())
            .await?
        {
            let delivery = message.delivery;
            messages.push((delivery.data, delivery.properties));
        }
        let _ = connection.close(200, "peeked".into()).await;
        Ok(messages)
    }
}

/// The string value of header `name`, if it has one.
pub fn header(properties: &BasicProperties, name: &str) -> Option<String> {
    match properties.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(value) => {
            Some(String::from_utf8_lossy(value.as_bytes()).into_owned())
        }
        AMQPValue::LongLongInt(value) => Some(value.to_string()),
        other => Some(format!("{other:?}")),
    }
}

impl Drop for RabbitMq {
    fn drop(&mut self) {
        self.stop();
        if let Some(mut epmd) = self.epmd.take() {
            stop_child(&mut epmd, Signal::SIGTERM, Duration::from_secs(5));
        }
    }
}

/// A durable RabbitMQ queue of a real node, quorum (`CLASSIC = false`) or classic.
#[derive(Debug)]
pub struct AmqpBroker<const CLASSIC: bool> {
    pub server: RabbitMq,
}

/// A quorum queue: RabbitMQ counts deliveries (`x-delivery-count`).
pub type AmqpQuorumBroker = AmqpBroker<false>;
/// A classic queue: the worker counts redeliveries itself.
pub type AmqpClassicBroker = AmqpBroker<true>;

impl<const CLASSIC: bool> AmqpBroker<CLASSIC> {
    pub const QUEUE_TYPE: QueueType = if CLASSIC {
        QueueType::Classic
    } else {
        QueueType::Quorum
    };

    /// Properties with a `message-id` of their own, as a producer would set.
    pub fn properties() -> lapin::BasicProperties {
        let id = format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..));
        lapin::BasicProperties::default().with_message_id(id.into())
    }

    /// Each dead letter of queue `name` with the text of its header `field` (`""` without).
    pub async fn dead_letters_with(
        &self,
        name: &str,
        field: &str,
    ) -> Result<Vec<(Vec<u8>, String)>> {
        let letters = self.server.peek(&format!("{name}.dlq")).await?;
        Ok(letters
            .into_iter()
            .map(|(body, properties)| {
                let value = header(&properties, field).unwrap_or_default();
                (body, value)
            })
            .collect())
    }
}

impl<const CLASSIC: bool> BrokerFixture for AmqpBroker<CLASSIC> {
    async fn start(_fx: &Fixture) -> Result<(Self, Vec<(String, String)>)> {
        let server = RabbitMq::start()?;
        let env = vec![("AMQP_URL".to_owned(), server.url())];
        Ok((Self { server }, env))
    }

    async fn create(&self, _fx: &Fixture, name: &str) -> Result<String> {
        let arguments = queue_arguments(Self::QUEUE_TYPE, &[]);
        self.server.declare(name, arguments.clone()).await?;
        self.server
            .declare(&format!("{name}.dlq"), arguments)
            .await?;
        Ok(format!("amqp: {{queue: {name}}}"))
    }

    fn delivery(&self) -> &'static str {
        "claimIdleSeconds: 2"
    }

    /// Each message with a `message-id` of its own, as a producer would set.
    async fn produce(&self, _fx: &Fixture, name: &str, bodies: Vec<Vec<u8>>) -> Result<()> {
        let messages = bodies.into_iter().map(|body| (body, Self::properties()));
        self.server.publish(name, messages).await
    }

    async fn unacknowledged(&self, _fx: &Fixture, name: &str) -> Result<u64> {
        self.server.messages(name).await
    }

    async fn dead_letters(&self, _fx: &Fixture, name: &str) -> Result<Vec<(Vec<u8>, String)>> {
        self.dead_letters_with(name, "x-switchboard-reason").await
    }

    async fn restart(&mut self, _fx: &mut Fixture) -> Result<()> {
        self.server.restart()
    }

    async fn crash(&mut self, _fx: &mut Fixture) -> Result<()> {
        self.server.crash()
    }

    fn address(&self, _fx: &Fixture) -> Result<String> {
        Ok(format!("127.0.0.1:{}", self.server.amqp_port))
    }

    async fn recreate(&self, _fx: &Fixture, name: &str) -> Result<()> {
        self.server
            .redeclare(name, queue_arguments(Self::QUEUE_TYPE, &[]))
            .await
    }

    /// A message whose headers are long-string entries of its `headers` table.
    async fn produce_with_headers(
        &self,
        _fx: &Fixture,
        name: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> Result<()> {
        let mut table = FieldTable::default();
        for (header, value) in headers {
            table.insert((*header).into(), text(value));
        }
        let properties = Self::properties().with_headers(table);
        self.server.publish(name, [(body, properties)]).await
    }

    /// Headers a producer may send that are no text: a byte array holding NUL and bytes that
    /// are not UTF-8, a long string that is not UTF-8, and a nested table of both.
    async fn produce_undecodable(&self, _fx: &Fixture, name: &str, body: Vec<u8>) -> Result<()> {
        let raw = vec![0x00, 0xff, 0xfe, b'x', 0x00];
        let mut nested = FieldTable::default();
        nested.insert("raw".into(), AMQPValue::ByteArray(raw.clone().into()));
        nested.insert(
            "latin1".into(),
            AMQPValue::LongString(LongString::from(b"caf\xe9".to_vec())),
        );
        let mut headers = FieldTable::default();
        headers.insert("raw".into(), AMQPValue::ByteArray(raw.into()));
        headers.insert(
            "latin1".into(),
            AMQPValue::LongString(LongString::from(b"caf\xe9".to_vec())),
        );
        headers.insert("nested".into(), AMQPValue::FieldTable(nested));
        let properties = Self::properties().with_headers(headers);
        self.server.publish(name, [(body, properties)]).await
    }

    /// The dead-letter queue holds nothing and refuses every publish (a nack): a classic queue
    /// (a quorum queue takes one message past its limit) with `x-max-length` 0 and
    /// `x-overflow: reject-publish`.
    async fn refuse_dead_letters(&self, _fx: &Fixture, name: &str) -> Result<()> {
        let limits = [
            ("x-max-length", AMQPValue::LongLongInt(0)),
            ("x-overflow", text("reject-publish")),
        ];
        self.server
            .redeclare(
                &format!("{name}.dlq"),
                queue_arguments(QueueType::Classic, &limits),
            )
            .await
    }
}

/// Whether RabbitMQ closed the connection with INTERNAL_ERROR (541).
fn internal_error(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause.downcast_ref::<lapin::Error>().is_some_and(|err| {
            matches!(err.kind(), lapin::ErrorKind::ProtocolError(amqp)
                if matches!(amqp.kind(), AMQPErrorKind::Hard(AMQPHardError::INTERNALERROR)))
        })
    })
}
