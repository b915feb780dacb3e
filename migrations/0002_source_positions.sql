-- Opaque per-source positions: the highest native position stored per source and partition
-- (a Redis stream's entry id as {ms, seq}, a Kafka partition's offset as {offset}, …). The store
-- compares positions of one partition element by element and never interprets them.
CREATE TABLE source_positions (
    source      text        NOT NULL,
    partition   text        NOT NULL DEFAULT '',
    position    bigint[]    NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, partition)
);

-- Positions stored before this migration (Redis streams: a single sequence per source).
-- source_checkpoints is no longer written; it stays for workers of the previous release
-- during a rolling upgrade.
INSERT INTO source_positions (source, partition, position, updated_at)
SELECT source, '', ARRAY[position_ms, position_seq], updated_at FROM source_checkpoints;
