-- Events kept for the dedup window, in time partitions dropped whole (docs/storage.md).
--
-- `events` becomes partitioned by arrival (`received_at`, the transaction's `now()`), one
-- partition per `event_storage.partition_interval` (a day), each with its own unique index on
-- (source, external_id). The old table stays, renamed `events_unpartitioned`, with its rows and
-- unique index, and is consulted by the dedup check until every row in it is older than the
-- window; then maintenance empties it. Nothing is copied, so the migration holds its locks
-- only for the catalog changes.
--
-- Why dedup stays exact: a redelivery is a duplicate when its key has an event (or a row in the
-- old table) — checked in a statement that starts after the locks below are held, so it sees
-- every transaction that committed before. A message whose broker time `t` every delivery
-- repeats (a Redis stream entry id, SQS SentTimestamp, a JetStream stream time, a Kafka record
-- timestamp; not a producer's id such as RabbitMQ's message-id, whose retry repeats it with
-- another time) is stored at greatest(now, t), and looked for only among events that arrived
-- at t or later: usually the current partition (and the empty ones ahead), not the whole
-- window. Any other key is stored at now and looked for in every partition.
-- Two deliveries in one partition collide on its unique index (ON CONFLICT waits for the other
-- and does nothing). Two in different partitions can only be concurrent around a partition
-- boundary: an ingest holds a shared advisory lock on (source, the upper bound of each
-- partition it writes to); an ingest within `event_storage.grace` after a partition bound
-- takes that bound's lock exclusively, so it waits until every ingest still writing below it
-- has ended, and its check sees them. Past the grace no such ingest is still running: each runs
-- under a statement_timeout of at most the grace (checked).

-- A statement of a running worker holds `events` for at most its statement_timeout; give up
-- sooner than that rather than queue every ingest behind this migration.
SET LOCAL lock_timeout = '10s';

-- The two tables this changes, locked before any change. A worker of the previous release takes
-- them in either order (its batch statement names `events` first when it is parsed, `todos`
-- first when it runs again from its plan cache), so waiting for one while holding the other
-- could deadlock with it (and fail this migration). Each attempt waits its turn for `events`
-- and takes `todos` only if it is free at once; otherwise it lets go of `events` (a statement
-- holding `todos` then gets it and ends) and tries again, for at most the lock timeout.
DO $$
DECLARE
    deadline timestamptz := clock_timestamp() + current_setting('lock_timeout')::interval;
BEGIN
    LOOP
        BEGIN
            LOCK TABLE events IN ACCESS EXCLUSIVE MODE;
            LOCK TABLE todos IN ACCESS EXCLUSIVE MODE NOWAIT;
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            IF clock_timestamp() > deadline THEN
                RAISE;
            END IF;
            PERFORM pg_sleep(0.01);
        END;
    END LOOP;
END
$$;

CREATE TABLE event_storage (
    singleton            boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    -- How much time one partition holds; a change applies to partitions created after it.
    partition_interval   interval    NOT NULL DEFAULT '1 day' CHECK (partition_interval > '0'),
    -- The longest statement_timeout an ingest may run under (see above).
    grace                interval    NOT NULL DEFAULT '10 minutes' CHECK (grace > '0'),
    -- Events at least this old are dropped by maintenance; set by the operator.
    dedup_window         interval    NOT NULL DEFAULT '30 days',
    -- Every row of events_unpartitioned arrived before this.
    unpartitioned_until  timestamptz NOT NULL DEFAULT now(),
    maintained_at        timestamptz
);
INSERT INTO event_storage DEFAULT VALUES;

-- The partitions of `events` and their bounds, written with each ATTACH and DETACH.
CREATE TABLE event_partitions (
    name   text        PRIMARY KEY,
    lower  timestamptz NOT NULL,
    upper  timestamptz NOT NULL,
    CHECK (lower < upper)
);
CREATE INDEX event_partitions_upper ON event_partitions (upper);

-- Todos keep their own payload and outlive the dedup window: no foreign key into `events`.
ALTER TABLE todos DROP CONSTRAINT todos_event_id_fkey;

ALTER TABLE events RENAME TO events_unpartitioned;

CREATE TABLE events (
    id           bigint      NOT NULL DEFAULT nextval('events_id_seq'),
    source       text        NOT NULL,
    external_id  text        NOT NULL,
    payload      jsonb       NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '{}',
    received_at  timestamptz NOT NULL DEFAULT now()
) PARTITION BY RANGE (received_at);
ALTER SEQUENCE events_id_seq OWNED BY events.id;

-- Creates the partition holding `at` unless one does: aligned to the interval (from the Unix
-- epoch, so a day is a UTC day) and clipped to its neighbours. ATTACH takes SHARE UPDATE
-- EXCLUSIVE on `events`: ingests go on meanwhile.
CREATE FUNCTION switchboard_add_event_partition(at timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    step   interval;
    secs   numeric;
    low    timestamptz;
    high   timestamptz;
    name   text;
BEGIN
    -- One creator at a time ('swbd' 'part').
    PERFORM pg_advisory_xact_lock(1937204836, 1885434484);
    IF EXISTS (SELECT 1 FROM event_partitions p WHERE p.lower <= at AND at < p.upper) THEN
        RETURN;
    END IF;
    SELECT partition_interval INTO step FROM event_storage;
    secs := extract(epoch FROM step);
    low := to_timestamp(floor(extract(epoch FROM at) / secs) * secs);
    high := to_timestamp((floor(extract(epoch FROM at) / secs) + 1) * secs);
    SELECT greatest(low, max(p.upper)) INTO low FROM event_partitions p WHERE p.upper <= at;
    SELECT least(high, min(p.lower)) INTO high FROM event_partitions p WHERE p.lower > at;
    name := 'events_p' || to_char(low AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISSUS');
    EXECUTE format('CREATE TABLE %I (LIKE events INCLUDING DEFAULTS)', name);
    EXECUTE format('CREATE UNIQUE INDEX %I ON %I (source, external_id)', name || '_key', name);
    EXECUTE format('ALTER TABLE events ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                   name, low, high);
    INSERT INTO event_partitions (name, lower, upper) VALUES (name, low, high);
END
$$;

SELECT switchboard_add_event_partition(now());

-- One batch of one source into one queue, in one statement (the worker's round trip). Returns
-- per input row (in order) whether it became a new event and a new todo.
--
-- By native id (`by_body` false): a message whose id has an event already is a duplicate,
-- whatever its todo's status; a batch holding one id twice stores its first message. The
-- highest position per partition of the source is advanced with the events. `sent_ms`: each
-- message's stable broker time (Unix ms), NULL where there is none (see the top).
-- By body hash (`by_body` true): identical bodies collapse while a live (pending or claimed)
-- todo holds the key; each stored body gets its own event (`<external id>@<event id>`). Run as
-- dynamic SQL: it must be planned for its actual keys (a generic plan filters live todos by
-- queue alone and slows down as the queue grows).
CREATE FUNCTION switchboard_ingest(
    p_source text, p_queue text, p_by_body boolean,
    p_external_ids text[], p_keys text[], p_payloads text[], p_headers text[],
    p_traceparents text[], p_tracestates text[], p_sent_ms bigint[],
    p_partitions text[], p_positions text[])
RETURNS TABLE (ord bigint, new_event boolean, new_todo boolean)
-- A batch takes milliseconds; its estimated cost grows with the table until PostgreSQL's JIT
-- (on by default) would compile it at every call, for longer than the batch itself.
SET jit = off
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    part       event_partitions;
    grace      interval;
    later      timestamptz[];
    bound      timestamptz;
    exclusive  boolean;
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

    -- `first_of_id`: a batch may hold one id twice (a producer's retry under an envelope id, an
    -- SQS standard queue's duplicate delivery): its first message is stored, the others are
    -- duplicates.
    RETURN QUERY
    WITH input AS (
        SELECT t.*, t.ord = min(t.ord) OVER (PARTITION BY t.external_id) AS first_of_id,
               coalesce(to_timestamp(t.sent_ms / 1000.0), '-infinity') AS since
        FROM unnest(p_external_ids, p_keys, p_payloads, p_headers, p_traceparents, p_tracestates,
                    p_sent_ms)
             WITH ORDINALITY AS t(external_id, idempotency_key, payload, headers, traceparent,
                                  tracestate, sent_ms, ord)
    ), new_events AS (
        INSERT INTO events (source, external_id, payload, headers, received_at)
        SELECT p_source, input.external_id, input.payload::jsonb, input.headers::jsonb,
               greatest(now(), input.since)
        FROM input
        WHERE input.first_of_id
          AND NOT EXISTS (SELECT 1 FROM events e
                          WHERE e.source = p_source AND e.external_id = input.external_id
                            AND e.received_at >= input.since)
          AND NOT EXISTS (SELECT 1 FROM events_unpartitioned e
                          WHERE e.source = p_source AND e.external_id = input.external_id)
        ORDER BY input.ord
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
