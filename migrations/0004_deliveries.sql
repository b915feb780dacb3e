-- The worker's own delivery counts, for brokers that do not count deliveries themselves (Kafka).
--
-- delivery_marks: per source and partition, the position up to which messages have been handed to
-- a worker's pipeline (exclusive), raised before each batch is handed on. A message below the mark
-- may have been delivered before (its worker died, or its partition moved); only such messages
-- are counted in deliveries. A message at or above it is a first delivery and writes nothing.
CREATE TABLE delivery_marks (
    source      text        NOT NULL,
    partition   text        NOT NULL,
    mark        bigint      NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, partition)
);

-- deliveries: how often a message that may be a redelivery was delivered (the first delivery,
-- never written, included), by its key within the source.
CREATE TABLE deliveries (
    source      text        NOT NULL,
    key         text        NOT NULL,
    count       bigint      NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, key)
);
