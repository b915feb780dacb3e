-- The QueueAdapter's metadata.uid, so that a row left by a deleted adapter is told from the row
-- of a re-created one of the same name (whose generation starts again at 1). NULL for rows
-- written before; the next reconcile fills it in.
ALTER TABLE adapters ADD COLUMN uid text;
