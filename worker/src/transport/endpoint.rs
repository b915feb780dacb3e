//! Where a broker is, for the lines that say it cannot be reached: `host:port`, never the
//! credentials, path or query of the URL it was given.

/// The `host:port` (or host) of each URL in `urls` (comma-separated), without scheme,
/// credentials, path or query.
pub fn endpoints(urls: &str) -> String {
    urls.split(',')
        .map(str::trim)
        .filter(|url| !url.is_empty())
        .map(authority)
        .collect::<Vec<_>>()
        .join(",")
}

fn authority(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_name_hosts_and_ports_never_credentials() {
        assert_eq!(endpoints("redis://app:hunter2@redis:6379/0"), "redis:6379");
        assert_eq!(
            endpoints("nats://u:p@a:4222, tls://b:4222"),
            "a:4222,b:4222"
        );
        assert_eq!(
            endpoints("kafka-1:9092,kafka-2:9092"),
            "kafka-1:9092,kafka-2:9092"
        );
        assert_eq!(
            endpoints("https://gw.example:8443/v1?token=x"),
            "gw.example:8443"
        );
        assert_eq!(endpoints("amqps://u:p%40ss@[::1]:5671/%2f"), "[::1]:5671");
    }
}
