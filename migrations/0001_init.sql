-- Switchboard core schema: adapter registry, events (the permanent dedup marker), todos.

CREATE TABLE adapters (
    id          bigserial PRIMARY KEY,
    name        text        NOT NULL UNIQUE,            -- "namespace/name"
    family      text        NOT NULL CHECK (family IN ('webhook', 'queue')),
    trust_mode  text        NOT NULL,                   -- 'connection' for queue adapters
    enabled     boolean     NOT NULL DEFAULT true,
    config      jsonb       NOT NULL DEFAULT '{}',      -- never holds secrets
    generation  bigint      NOT NULL DEFAULT 0,         -- newer generations win
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE events (
    id           bigserial PRIMARY KEY,
    source       text        NOT NULL,                  -- e.g. "redis:namespace/name"
    external_id  text        NOT NULL,                  -- native message id, or "sha256:<hex>@<event id>"
    payload      jsonb       NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '{}',
    received_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (source, external_id)
);

CREATE TABLE todos (
    id               bigserial PRIMARY KEY,
    queue            text        NOT NULL,
    idempotency_key  text        NOT NULL,
    event_id         bigint      REFERENCES events (id),
    status           text        NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'claimed', 'done', 'failed', 'cancelled')),
    payload          jsonb       NOT NULL,
    attempts         integer     NOT NULL DEFAULT 0,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now()
);

-- One live todo per key; terminal todos (done, failed, cancelled) no longer block a new one.
CREATE UNIQUE INDEX todos_live_idempotency_key ON todos (queue, idempotency_key)
    WHERE status IN ('pending', 'claimed');
CREATE INDEX todos_queue_status ON todos (queue, status, id);

-- Highest native stream position stored per source: where a lost consumer group is recreated.
CREATE TABLE source_checkpoints (
    source        text        PRIMARY KEY,
    position_ms   bigint      NOT NULL,
    position_seq  bigint      NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
