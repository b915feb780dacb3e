-- The attempt history of messages the worker saw delivered more than once: each row of
-- `deliveries` (one per message, by its key within the source) also keeps the most recent
-- attempts (JSON objects: delivery, at, consumer, outcome, error), which its dead letter carries
-- if it ends there. Rows are deleted once their message is settled, and pruned after the
-- dead-letter retention.
ALTER TABLE deliveries ADD COLUMN attempts jsonb NOT NULL DEFAULT '[]';
CREATE INDEX deliveries_updated_at ON deliveries (source, updated_at);
