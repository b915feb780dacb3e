-- Keys without a broker time, kept in two generations instead of looked for in every partition
-- (docs/storage.md).
--
-- Until now a key without a broker time (a RabbitMQ message-id, a CloudEvents or SNS id, a
-- redriven copy's original key) was looked for in every partition of `events`: one index probe
-- per partition of the window (31 by default) for every new key. Such keys now also go into
-- `event_keys`, two generations of (source, external_id) listed by `generation`, each with its
-- own unique index: a new key is looked for in both (two probes) and inserted into the current
-- one. Every dedup window maintenance empties the older generation (`TRUNCATE`, never a bulk
-- `DELETE`) and makes it the current: a key is kept for one to two windows.
--
-- Why dedup stays exact: every stored key still has its event (a lookup by broker time finds
-- it there). A key without a broker time is stored by deliveries without one only, each of
-- which writes `event_keys`: two concurrent ones collide on the current generation's unique
-- index (`ON CONFLICT DO NOTHING` waits for the other and does nothing). A rotation takes
-- ACCESS EXCLUSIVE on `event_keys`; an ingest writing keys holds ROW EXCLUSIVE on it from
-- before it reads which generation is current until it commits, so no ingest runs across a
-- rotation, and the keys of every ingest before it are in the generation that becomes the older.
-- A redriven copy's original key may have been stored with a broker time: it is looked for
-- everywhere (`p_sent_ms` 0: since the epoch) and in `event_keys`, and written there too.
-- Keys stored before this migration are only in `events`: a key without a broker time is also
-- looked for in the partitions before `keys_since` until the window has passed them.

SET LOCAL lock_timeout = '10s';

-- Waits for the ingests of the previous function still running (milliseconds) and holds new
-- ones until this commits (catalog changes only): every event written before is then older
-- than `keys_since`, every later ingest runs the new function. In the order that function takes
-- them (it reads `event_storage` before it writes `events`): holding `events` while waiting for
-- `event_storage` would deadlock with an ingest between the two.
LOCK TABLE event_storage IN ACCESS EXCLUSIVE MODE;
LOCK TABLE events IN SHARE MODE;

CREATE TABLE event_keys (
    generation   smallint NOT NULL,
    source       text     NOT NULL,
    external_id  text     NOT NULL
) PARTITION BY LIST (generation);
CREATE TABLE event_keys_0 PARTITION OF event_keys FOR VALUES IN (0);
CREATE TABLE event_keys_1 PARTITION OF event_keys FOR VALUES IN (1);
CREATE UNIQUE INDEX event_keys_0_key ON event_keys_0 (source, external_id);
CREATE UNIQUE INDEX event_keys_1_key ON event_keys_1 (source, external_id);

ALTER TABLE event_storage
    -- The generation of `event_keys` new keys go into; the other is older.
    ADD COLUMN keys_generation  smallint    NOT NULL DEFAULT 0 CHECK (keys_generation IN (0, 1)),
    -- When the current generation became current: the older is emptied a window after it.
    ADD COLUMN keys_rotated_at  timestamptz NOT NULL DEFAULT now(),
    -- Keys without a broker time stored before this are in `events` only.
    ADD COLUMN keys_since       timestamptz NOT NULL DEFAULT now();
UPDATE event_storage
SET keys_since = CASE WHEN EXISTS (SELECT 1 FROM events) THEN clock_timestamp() ELSE '-infinity' END;

-- As in 0009, but a key without a broker time (`p_sent_ms` NULL) is looked for in `event_keys`
-- and in the partitions before `keys_since`, and a redriven copy's (`p_sent_ms` 0) everywhere.
CREATE OR REPLACE FUNCTION switchboard_ingest(
    p_source text, p_queue text, p_by_body boolean,
    p_external_ids text[], p_keys text[], p_payloads text[], p_headers text[],
    p_traceparents text[], p_tracestates text[], p_sent_ms bigint[],
    p_partitions text[], p_positions text[])
RETURNS TABLE (ord bigint, new_event boolean, new_todo boolean)
SET jit = off
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    part        event_partitions;
    grace       interval;
    later       timestamptz[];
    bound       timestamptz;
    exclusive   boolean;
    current_generation  smallint;
    unkeyed_before      timestamptz;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'switchboard_ingest needs the READ COMMITTED isolation level, not % (default_transaction_isolation)',
            current_setting('transaction_isolation') USING ERRCODE = '55000';
    END IF;
    SELECT s.grace INTO grace FROM event_storage s;
    IF current_setting('statement_timeout')::interval NOT BETWEEN '1 millisecond' AND grace THEN
        RAISE EXCEPTION 'statement_timeout is %; an ingest needs one between 1ms and event_storage.grace (%): the worker sets it to nine tenths of --database-timeout',
            current_setting('statement_timeout'), grace USING ERRCODE = '55000';
    END IF;
    SELECT * INTO part FROM event_partitions p WHERE p.lower <= now() AND now() < p.upper;
    IF NOT FOUND THEN
        -- Maintenance has not created it (yet): ingestion does not wait for it.
        PERFORM switchboard_add_event_partition(now());
        SELECT * INTO part FROM event_partitions p WHERE p.lower <= now() AND now() < p.upper;
    END IF;

    IF p_by_body THEN
        RETURN QUERY EXECUTE $body$
WITH input AS (
    SELECT *
    FROM unnest($3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[])
         WITH ORDINALITY AS t(external_id, idempotency_key, payload, headers, traceparent,
                              tracestate, ord)
), fresh AS (
    SELECT DISTINCT ON (input.idempotency_key)
           input.ord, input.external_id, input.idempotency_key, input.payload, input.headers,
           input.traceparent, input.tracestate, nextval('events_id_seq') AS event_id
    FROM input
    LEFT JOIN LATERAL (
        SELECT 1 AS found FROM todos
        WHERE todos.queue = $2 AND todos.idempotency_key = input.idempotency_key
          AND todos.status IN ('pending', 'claimed')
        LIMIT 1
    ) live ON true
    WHERE live.found IS NULL
    ORDER BY input.idempotency_key, input.ord
), new_events AS (
    INSERT INTO events (id, source, external_id, payload, headers)
    SELECT event_id, $1, external_id || '@' || event_id, payload::jsonb, headers::jsonb
    FROM fresh ORDER BY ord
    RETURNING id, payload
), new_todos AS (
    INSERT INTO todos (queue, idempotency_key, event_id, payload, traceparent, tracestate)
    SELECT $2, fresh.idempotency_key, new_events.id, new_events.payload, fresh.traceparent,
           fresh.tracestate
    FROM new_events JOIN fresh ON fresh.event_id = new_events.id
    ORDER BY fresh.ord
    ON CONFLICT (queue, idempotency_key) WHERE status IN ('pending', 'claimed') DO NOTHING
    RETURNING event_id
)
SELECT input.ord, fresh.event_id IS NOT NULL, new_todos.event_id IS NOT NULL
FROM input
LEFT JOIN fresh USING (ord)
LEFT JOIN new_todos ON new_todos.event_id = fresh.event_id
ORDER BY input.ord
$body$
        USING p_source, p_queue, p_external_ids, p_keys, p_payloads, p_headers,
              p_traceparents, p_tracestates;
        RETURN;
    END IF;

    -- Broker times later than now (a clock ahead of the database's): stored there.
    SELECT array_agg(DISTINCT to_timestamp(ms / 1000.0)) INTO later
    FROM unnest(p_sent_ms) AS ms WHERE to_timestamp(ms / 1000.0) > now();
    FOR bound IN SELECT unnest(later) LOOP
        IF NOT EXISTS (SELECT 1 FROM event_partitions p WHERE p.lower <= bound AND bound < p.upper) THEN
            PERFORM switchboard_add_event_partition(bound);
        END IF;
    END LOOP;
    -- The bounds' locks, in ascending order (no deadlock): exclusive on the bounds passed within
    -- the grace, shared on the upper bound of every partition written to. Keys: the source and
    -- the bound in epoch seconds (not text: that depends on the session's TimeZone).
    FOR bound, exclusive IN
        SELECT p.lower, true FROM event_partitions p
        WHERE p.lower > now() - grace AND p.lower <= now()
        UNION ALL
        SELECT p.upper, false FROM event_partitions p
        WHERE (p.lower <= now() AND now() < p.upper)
           OR EXISTS (SELECT 1 FROM unnest(later) AS t WHERE p.lower <= t AND t < p.upper)
        ORDER BY 1
    LOOP
        IF exclusive THEN
            PERFORM pg_advisory_xact_lock(
                hashtextextended(p_source || '@' || extract(epoch FROM bound)::text, 0));
        ELSE
            PERFORM pg_advisory_xact_lock_shared(
                hashtextextended(p_source || '@' || extract(epoch FROM bound)::text, 0));
        END IF;
    END LOOP;
    -- Held until commit: no rotation of the generations runs until then (see the top).
    IF EXISTS (SELECT 1 FROM unnest(p_sent_ms) AS ms WHERE ms IS NULL OR ms = 0) THEN
        LOCK TABLE event_keys IN ROW EXCLUSIVE MODE;
    END IF;
    SELECT s.keys_generation, s.keys_since INTO current_generation, unkeyed_before FROM event_storage s;

    -- `first_of_id`: a batch may hold one id twice (a producer's retry under an envelope id, an
    -- SQS standard queue's duplicate delivery): its first message is stored, the others are
    -- duplicates. An earlier event is looked for among those that arrived in [lo, hi).
    RETURN QUERY
    WITH input AS (
        SELECT t.*, t.ord = min(t.ord) OVER (PARTITION BY t.external_id) AS first_of_id,
               t.sent_ms IS NULL OR t.sent_ms = 0 AS keyed,
               coalesce(to_timestamp(t.sent_ms / 1000.0), '-infinity') AS lo,
               CASE WHEN t.sent_ms IS NULL THEN unkeyed_before ELSE 'infinity' END AS hi
        FROM unnest(p_external_ids, p_keys, p_payloads, p_headers, p_traceparents, p_tracestates,
                    p_sent_ms)
             WITH ORDINALITY AS t(external_id, idempotency_key, payload, headers, traceparent,
                                  tracestate, sent_ms, ord)
    ), unseen AS (
        SELECT input.* FROM input
        WHERE input.first_of_id
          AND NOT EXISTS (SELECT 1 FROM events e
                          WHERE e.source = p_source AND e.external_id = input.external_id
                            AND e.received_at >= input.lo AND e.received_at < input.hi)
          AND NOT EXISTS (SELECT 1 FROM events_unpartitioned e
                          WHERE e.source = p_source AND e.external_id = input.external_id)
    ), new_keys AS (
        INSERT INTO event_keys (generation, source, external_id)
        SELECT current_generation, p_source, unseen.external_id FROM unseen
        WHERE unseen.keyed
          AND NOT EXISTS (SELECT 1 FROM event_keys k
                          WHERE k.source = p_source AND k.external_id = unseen.external_id)
        -- In key order: concurrent batches sharing keys wait on each other, never in a cycle.
        ORDER BY unseen.external_id
        ON CONFLICT DO NOTHING
        RETURNING event_keys.external_id
    ), new_events AS (
        INSERT INTO events (source, external_id, payload, headers, received_at)
        SELECT p_source, unseen.external_id, unseen.payload::jsonb, unseen.headers::jsonb,
               greatest(now(), unseen.lo)
        FROM unseen
        WHERE NOT unseen.keyed
           OR unseen.external_id IN (SELECT new_keys.external_id FROM new_keys)
        ORDER BY unseen.ord
        ON CONFLICT DO NOTHING
        RETURNING events.id, events.external_id, events.payload
    ), new_todos AS (
        INSERT INTO todos (queue, idempotency_key, event_id, payload, traceparent, tracestate)
        SELECT p_queue, input.idempotency_key, new_events.id, new_events.payload,
               input.traceparent, input.tracestate
        FROM new_events JOIN input USING (external_id)
        WHERE input.first_of_id
        ORDER BY input.ord
        ON CONFLICT (queue, idempotency_key) WHERE status IN ('pending', 'claimed') DO NOTHING
        RETURNING todos.event_id
    ), checkpoint AS (
        INSERT INTO source_positions (source, partition, position)
        SELECT p_source, pos.partition, pos.position::bigint[]
        FROM unnest(p_partitions, p_positions) AS pos(partition, position)
        WHERE EXISTS (SELECT 1 FROM new_events)
        ON CONFLICT (source, partition) DO UPDATE
            SET position = EXCLUDED.position, updated_at = now()
            WHERE source_positions.position < EXCLUDED.position
    )
    SELECT input.ord,
           input.first_of_id AND new_events.id IS NOT NULL,
           input.first_of_id AND new_todos.event_id IS NOT NULL
    FROM input
    LEFT JOIN new_events USING (external_id)
    LEFT JOIN new_todos ON new_todos.event_id = new_events.id
    ORDER BY input.ord;
END
$$;

-- Empties the older generation of `event_keys` and makes it the current once the current has
-- been current for `dedup_window`; returns whether it did. Run by maintenance.
CREATE FUNCTION switchboard_rotate_event_keys() RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    storage  event_storage;
BEGIN
    -- One rotation at a time: a second run waits here, then finds it done.
    SELECT * INTO storage FROM event_storage FOR UPDATE;
    IF storage.keys_rotated_at > now() - storage.dedup_window THEN
        RETURN false;
    END IF;
    -- Waits for the ingests writing keys (milliseconds each) and holds new ones meanwhile.
    LOCK TABLE event_keys IN ACCESS EXCLUSIVE MODE;
    EXECUTE format('TRUNCATE event_keys_%s', 1 - storage.keys_generation);
    UPDATE event_storage
    SET keys_generation = 1 - storage.keys_generation, keys_rotated_at = now();
    RETURN true;
END
$$;
