-- tritask_sqlite schema version 3: the durable queue and concurrency keys (issue 15).
--
-- Rows written by versions 1 and 2 have NULL in every new column: not queued, no concurrency key.

-- A task submitted unclaimed (queued): the JSON text of the status message its first claim
-- gives back (the record says QUEUED_MESSAGE meanwhile). NULL once claimed, or never queued.
ALTER TABLE tritask_tasks ADD COLUMN queued_message TEXT
    CHECK (queued_message IS NULL
           OR (typeof(queued_message) = 'text' AND json_valid(queued_message)
               AND json_type(queued_message) IN ('text', 'null')));

-- A concurrency key (canonical JSON text) and its limit: at most concurrency_limit tasks of
-- one key hold a live claim at once. Both or neither.
ALTER TABLE tritask_tasks ADD COLUMN concurrency_key TEXT
    CHECK (concurrency_key IS NULL
           OR (typeof(concurrency_key) = 'text' AND json_valid(concurrency_key)));

ALTER TABLE tritask_tasks ADD COLUMN concurrency_limit INTEGER
    CHECK ((concurrency_limit IS NULL) = (concurrency_key IS NULL)
           AND (concurrency_limit IS NULL
                OR (typeof(concurrency_limit) = 'integer' AND concurrency_limit > 0)));

-- claim_next within one key: its active tasks in creation order.
CREATE INDEX tritask_tasks_key_queue
    ON tritask_tasks (concurrency_key, created_at_us, task_id)
    WHERE concurrency_key IS NOT NULL AND status IN ('working', 'input_required');

-- The claims of each key, counted under the write reservation.
CREATE INDEX tritask_tasks_key_claims
    ON tritask_tasks (concurrency_key)
    WHERE concurrency_key IS NOT NULL AND claim_token IS NOT NULL;
