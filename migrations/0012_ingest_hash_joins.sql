-- The batch statement joins its CTEs by hashing, whatever the batch size (docs/storage.md).
--
-- With the generic plan of 0011, PostgreSQL takes every `unnest` of the batch's arrays for ten
-- rows, and so joined the statement's CTEs (the batch, the events and todos inserted) with
-- nested loops: work growing with the square of the batch. A batch of 1,000 took 77 ms
-- (`pgbench`, one session) against 46 with 0010's per-call plans, and `make bench` measured
-- PostgreSQL at 48-83 µs per message in batches of 500-1,000 against 24-25 with 0010. With
-- nested loops off for the function those joins are hash joins (18.6 ms a batch of 500, 34.6
-- a batch of 1,000); the per-key probes (`LATERAL … LIMIT 1`) can only be nested loops and
-- stay so. A migration that redefines the function (`CREATE OR REPLACE` resets its settings)
-- must repeat this with 0011's two (tests/tests/storage.rs checks all three).

ALTER FUNCTION switchboard_ingest(
    text, text, boolean, text[], text[], text[], text[], text[], text[], bigint[], text[], text[])
    SET enable_nestloop = off;
