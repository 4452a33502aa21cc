-- tritask PostgreSQL store, schema version 3: the durable queue and concurrency keys (issue 15).
--
-- Rows written by versions 1 and 2 get NULL in every new column: not queued, no concurrency key.

-- A task submitted unclaimed (queued): the JSON text of the status message its first claim
-- gives back (its record says "Queued: ..." meanwhile). NULL once claimed, or never queued.
ALTER TABLE tasks ADD COLUMN queued_message text
    CHECK (queued_message IS NULL OR json_typeof(queued_message::json) IN ('string', 'null'));

-- A concurrency key (canonical JSON text, compared as exact text) and its limit: at most
-- concurrency_limit tasks of one key hold a live claim at once. Both or neither.
ALTER TABLE tasks ADD COLUMN concurrency_key text COLLATE "C";
ALTER TABLE tasks ADD COLUMN concurrency_limit integer;
ALTER TABLE tasks ADD CONSTRAINT tasks_concurrency_shape CHECK (
    (concurrency_key IS NULL) = (concurrency_limit IS NULL)
    AND (concurrency_limit IS NULL OR concurrency_limit > 0)
);

-- claim_next within one key: its active tasks in creation order.
CREATE INDEX tasks_key_queue ON tasks (concurrency_key, created_at_us, task_id)
    WHERE concurrency_key IS NOT NULL AND status IN ('working', 'input_required');

-- the live claims of each key, counted under the key lock
CREATE INDEX tasks_key_claims ON tasks (concurrency_key)
    WHERE concurrency_key IS NOT NULL AND claim_token IS NOT NULL;
