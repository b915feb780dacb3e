-- What each worker last saw of its queue, written every few seconds; the operator aggregates the
-- fresh ones into QueueAdapter status (BACKLOG, OLDEST, conditions) and deletes the stale ones.
CREATE TABLE worker_reports (
    adapter       text        NOT NULL,            -- "namespace/name"
    worker        text        NOT NULL,            -- the consumer name (the pod's name)
    reported_at   timestamptz NOT NULL DEFAULT now(),
    backlog       bigint,                          -- NULL: the broker does not say
    pending       bigint,
    oldest_since  timestamptz,                     -- when the oldest unacknowledged message arrived
    dead_letters  bigint,
    broker_up     boolean     NOT NULL,
    database_up   boolean     NOT NULL,            -- the worker's last store attempt succeeded
    PRIMARY KEY (adapter, worker)
);
