-- The W3C trace context of the message a todo came from (worker/src/trace_context.rs), so that
-- the todos capability can continue the producer's trace: `traceparent` normalised to version
-- 00, `tracestate` only beside a valid `traceparent`. NULL when the message had none.
-- Additive: nullable columns without a default change only the catalogue (no table rewrite).
ALTER TABLE todos ADD COLUMN traceparent text, ADD COLUMN tracestate text;
