//! A moto server (`moto_server`, installed by scripts/moto.sh from PyPI) as a child process on a
//! random loopback port: SQS where credentials and regions must be checked (ElasticMQ accepts
//! any), and SNS, which ElasticMQ does not have.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use aws_sdk_sqs::Client;

use crate::brokers::sqs::sqs_client;
use crate::servers::free_port;
use crate::wait::wait_until;

/// How moto gets installed (`make sqs-server` runs it).
pub const MOTO_INSTALL: &str = "scripts/moto.sh (make sqs-server)";

/// `moto_server`: `$MOTO_SERVER`, else the virtualenv scripts/moto.sh installs.
pub fn moto_server() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("MOTO_SERVER") {
        return Ok(PathBuf::from(path));
    }
    let cache = std::env::var_os("SWITCHBOARD_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|home| Path::new(&home).join(".cache/switchboard"))
        })
        .context("no HOME to find the cache in")?;
    let path = cache.join("moto-5.2.5/venv/bin/moto_server");
    anyhow::ensure!(
        path.is_file(),
        "{} is missing: install moto with `{MOTO_INSTALL}`",
        path.display()
    );
    Ok(path)
}

/// A moto server (`moto_server`), killed on drop. With `check_credentials` every request is
/// authenticated against moto's (empty) IAM, so any access key is refused.
pub struct Moto {
    child: Child,
    port: u16,
}

impl Moto {
    pub fn start(check_credentials: bool, log: &Path) -> Result<Self> {
        let port = free_port()?;
        let file = std::fs::File::create(log)?;
        let mut command = Command::new(moto_server()?);
        command
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        if check_credentials {
            command.env("INITIAL_NO_AUTH_ACTION_COUNT", "0");
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting moto_server; install it with `{MOTO_INSTALL}`"))?;
        let mut moto = Self { child, port };
        let mut exited = None;
        wait_until(
            Duration::from_secs(30),
            "moto_server accepts connections",
            || {
                if let Ok(Some(status)) = moto.child.try_wait() {
                    exited = Some(status);
                    return true;
                }
                TcpStream::connect(("127.0.0.1", moto.port)).is_ok()
            },
        )?;
        if let Some(status) = exited {
            bail!(
                "moto_server exited at start-up ({status}); install it with `{MOTO_INSTALL}`\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        Ok(moto)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Calls SNS's query API (`Action=…` form parameters) in `us-east-1`; returns the XML
    /// answer. Unsigned: moto checks no signature unless told to, and finds the service in the
    /// credential scope of the `Authorization` header.
    pub fn sns(&self, params: &[(&str, &str)]) -> Result<String> {
        use std::io::{Read as _, Write as _};
        let form: Vec<String> = params
            .iter()
            .chain(&[("Version", "2010-03-31")])
            .map(|(name, value)| format!("{}={}", form_encoded(name), form_encoded(value)))
            .collect();
        let form = form.join("&");
        let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        write!(
            stream,
            "POST / HTTP/1.0\r\nHost: sns.us-east-1.amazonaws.com\r\n\
             Authorization: AWS4-HMAC-SHA256 Credential=x/20261201/us-east-1/sns/aws4_request, SignedHeaders=host, Signature=x\r\n\
             Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{form}",
            form.len()
        )?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let (head, body) = response
            .split_once("\r\n\r\n")
            .context("malformed HTTP response from moto")?;
        anyhow::ensure!(
            head.split_whitespace().nth(1) == Some("200"),
            "SNS {params:?} failed: {head}\n{body}"
        );
        Ok(body.to_owned())
    }

    /// A client of region `region` with fixed test credentials.
    pub fn client(&self, region: &str) -> Client {
        sqs_client(&self.endpoint(), region)
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `application/x-www-form-urlencoded` encoding of one name or value.
fn form_encoded(text: &str) -> String {
    text.bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(byte).to_string()
            }
            _ => format!("%{byte:02X}"),
        })
        .collect()
}
