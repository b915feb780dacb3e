-- Keys without a broker time are indexed by a hash of (source, external_id), not a B-tree
-- (docs/storage.md).
--
-- A key without a broker time (a RabbitMQ message-id, a CloudEvents or SNS id) is random: each
-- probe and insert of `event_keys` lands on a random page of its index. With a unique B-tree on
-- (source, external_id) that index is about 120 bytes per key (3 GB for the 25 million keys of
-- the bench's growth row), it outgrows what stays cached, and after every checkpoint the first
-- change to each of its pages writes the whole page to the WAL: into 50 million events the
-- worker kept 37-63% of its empty-table rate (docs/PERFORMANCE.md, the growth row). A hash
-- index keeps the key's 4-byte hash code, not the key (an entry of 16 bytes, about 27 a key
-- with its line pointer and fill factor), and a probe reads one bucket page instead of
-- descending a tree of text comparisons: on 16 million keys, batches of
-- 500 new keys probed in two generations and inserted into one ran 1.7 times as fast with
-- everything cached and 2.2 times as fast with 768 MB of shared buffers, with a third of the WAL.
--
-- A hash index cannot be UNIQUE; an exclusion constraint on it (`EXCLUDE USING hash (… WITH
-- =)`) is, and it is an arbiter for `ON CONFLICT DO NOTHING` as the unique index was: two
-- concurrent ingests of one key still collide, the second waits for the first and does nothing.
-- A hash index holds one column: the pair, as an array (`ARRAY[source, external_id]`, which no
-- two different pairs share).
--
-- Online: building the index over a generation full of keys would hold `event_keys` (and so
-- every ingest) for as long as it takes. A generation that is empty now is converted here; one
-- that holds keys keeps its B-tree until the rotation that empties it (`TRUNCATE`) converts it,
-- under the lock the rotation already takes. Until then the batch statement probes both forms.

SET LOCAL lock_timeout = '10s';

-- Waits for the ingests writing keys (milliseconds each) and holds new ones until this commits,
-- so a generation found empty stays empty until it is converted.
LOCK TABLE event_keys IN ACCESS EXCLUSIVE MODE;

-- Gives generation `generation` of `event_keys`, which must be empty, the hash layout: drops its
-- B-tree (`event_keys_N_key`, 0010) and adds the constraint `event_keys_N_hash`; nothing if done.
CREATE FUNCTION switchboard_hash_event_keys(generation smallint) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    holds_keys  boolean;
BEGIN
    IF to_regclass(format('event_keys_%s_key', generation)) IS NULL THEN
        RETURN;
    END IF;
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM event_keys_%s)', generation) INTO holds_keys;
    IF holds_keys THEN
        RAISE EXCEPTION 'event_keys_% holds keys: it is given the hash layout only once emptied', generation;
    END IF;
    EXECUTE format('DROP INDEX event_keys_%s_key', generation);
    EXECUTE format(
        'ALTER TABLE event_keys_%1$s ADD CONSTRAINT event_keys_%1$s_hash '
        'EXCLUDE USING hash ((ARRAY[source, external_id]) WITH =)', generation);
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM event_keys_0) THEN
        PERFORM switchboard_hash_event_keys(0::smallint);
    END IF;
    IF NOT EXISTS (SELECT 1 FROM event_keys_1) THEN
        PERFORM switchboard_hash_event_keys(1::smallint);
    END IF;
END
$$;

-- As in 0011, but `event_keys` is probed in both layouts (above).
CREATE OR REPLACE FUNCTION switchboard_ingest(
    p_source text, p_queue text, p_by_body boolean,
    p_external_ids text[], p_keys text[], p_payloads text[], p_headers text[],
    p_traceparents text[], p_tracestates text[], p_sent_ms bigint[],
    p_partitions text[], p_positions text[])
RETURNS TABLE (ord bigint, new_event boolean, new_todo boolean)
SET jit = off
SET plan_cache_mode = force_generic_plan
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
        -- Each lookup is a probe per key (LATERAL … LIMIT 1), whatever the statistics: the
        -- plan is generic, and made while the day's partition may still be empty.
        SELECT input.* FROM input
        LEFT JOIN LATERAL (
            SELECT 1 AS found FROM events e
            WHERE e.source = p_source AND e.external_id = input.external_id
              AND e.received_at >= input.lo AND e.received_at < input.hi
            LIMIT 1
        ) seen ON true
        LEFT JOIN LATERAL (
            SELECT 1 AS found FROM events_unpartitioned e
            WHERE e.source = p_source AND e.external_id = input.external_id
            LIMIT 1
        ) seen_before ON true
        WHERE input.first_of_id AND seen.found IS NULL AND seen_before.found IS NULL
    ), new_keys AS (
        INSERT INTO event_keys (generation, source, external_id)
        SELECT current_generation, p_source, unseen.external_id FROM unseen
        LEFT JOIN LATERAL (
            -- Both forms: a generation still in 0010's layout is probed by its B-tree on
            -- (source, external_id), one in the hash layout by its hash of the pair.
            SELECT 1 AS found FROM event_keys k
            WHERE ARRAY[k.source, k.external_id] = ARRAY[p_source, unseen.external_id]
              AND k.source = p_source AND k.external_id = unseen.external_id
            LIMIT 1
        ) known ON true
        WHERE unseen.keyed AND known.found IS NULL
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

-- `CREATE OR REPLACE` reset the function's settings: 0011's two are in its definition, 0012's:
ALTER FUNCTION switchboard_ingest(
    text, text, boolean, text[], text[], text[], text[], text[], text[], bigint[], text[], text[])
    SET enable_nestloop = off;

-- As in 0010, and the generation it empties is given the hash layout.
CREATE OR REPLACE FUNCTION switchboard_rotate_event_keys() RETURNS boolean
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
    PERFORM switchboard_hash_event_keys((1 - storage.keys_generation)::smallint);
    UPDATE event_storage
    SET keys_generation = 1 - storage.keys_generation, keys_rotated_at = now();
    RETURN true;
END
$$;
