-- Dead letters the broker's dead-letter destination permanently refused (too large for it, a
-- publish it rejects however often it is retried): kept here so that the original can still be
-- acknowledged. Nothing is lost and nothing blocks. `switchboard-worker dlq` reads them too.
CREATE TABLE dead_letters (
    id               bigserial   PRIMARY KEY,
    source           text        NOT NULL,            -- "{kind}:{adapter}"
    idempotency_key  text        NOT NULL,            -- the original's key: one row per message
    external_id      text        NOT NULL,
    body             bytea       NOT NULL,            -- byte-identical
    headers          jsonb       NOT NULL DEFAULT '{}', -- as events.headers (base64 where needed)
    reason           text        NOT NULL,            -- invalid_json, max_deliveries, …
    error            text        NOT NULL DEFAULT '',
    delivery_count   bigint      NOT NULL,
    attempts         jsonb       NOT NULL DEFAULT '{}',
    refused_because  text        NOT NULL,            -- what the broker answered
    dead_lettered_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (source, idempotency_key)
);
