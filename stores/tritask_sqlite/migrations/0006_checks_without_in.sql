-- tritask_sqlite schema version 6: CHECKs without IN lists (issue 15).
--
-- Schema 5 checked the task's status and the ledger's event kind with `col IN ('a', 'b', ...)`.
-- SQLite evaluates a constant IN list of more than two values by building an ephemeral table of
-- its values (an OpenEphemeral: a b-tree created, filled and dropped) on every execution of a
-- statement that checks it: the creation's INSERT, the settle's UPDATE (it writes the status)
-- and every ledger INSERT, three per task. Measured with callgrind on the store-only loop, that
-- was about a tenth of all the instructions per task. The same checks written as comparisons
-- joined by OR admit exactly the same values and are evaluated in place.
--
-- SQLite cannot alter a CHECK, so both tables are rebuilt as in version 5: the same columns,
-- rows (rowids too), keys, other CHECKs and indexes; the ledger is rebuilt first, referencing
-- the new task table, the old tables are dropped child first and the new ones renamed.

PRAGMA legacy_alter_table = OFF;

CREATE TABLE tritask_tasks_v6 (
    task_id TEXT PRIMARY KEY NOT NULL
        CHECK (typeof(task_id) = 'text' AND length(task_id) > 0),
    row_format INTEGER NOT NULL DEFAULT 1
        CHECK (typeof(row_format) = 'integer' AND row_format = 1),
    record_version INTEGER NOT NULL
        CHECK (typeof(record_version) = 'integer' AND record_version > 0),
    record TEXT NOT NULL
        CHECK (typeof(record) = 'text' AND substr(record, 1, 1) = '{'),
    scope TEXT NOT NULL
        CHECK (typeof(scope) = 'text' AND substr(scope, 1, 1) = '{'),
    revision INTEGER NOT NULL
        CHECK (typeof(revision) = 'integer' AND revision >= 0),
    status TEXT NOT NULL
        CHECK (status = 'working' OR status = 'input_required' OR status = 'completed'
               OR status = 'failed' OR status = 'cancelled'),
    created_at_us INTEGER NOT NULL
        CHECK (typeof(created_at_us) = 'integer' AND created_at_us >= 0),
    expires_at_us INTEGER
        CHECK (expires_at_us IS NULL
               OR (typeof(expires_at_us) = 'integer' AND expires_at_us >= created_at_us)),
    retry_at_us INTEGER
        CHECK (retry_at_us IS NULL OR typeof(retry_at_us) = 'integer'),
    claim_owner TEXT
        CHECK (claim_owner IS NULL OR typeof(claim_owner) = 'text'),
    claim_token TEXT
        CHECK (claim_token IS NULL OR (typeof(claim_token) = 'text' AND length(claim_token) = 36)),
    lease_generation INTEGER NOT NULL DEFAULT 0
        CHECK (typeof(lease_generation) = 'integer' AND lease_generation >= 0),
    claim_expires_at_us INTEGER
        CHECK (claim_expires_at_us IS NULL OR typeof(claim_expires_at_us) = 'integer'),
    claim_epoch INTEGER
        CHECK (claim_epoch IS NULL OR (typeof(claim_epoch) = 'integer' AND claim_epoch >= 0)),
    queued_message TEXT
        CHECK (queued_message IS NULL
               OR (typeof(queued_message) = 'text' AND json_valid(queued_message)
                   AND json_type(queued_message) IN ('text', 'null'))),
    concurrency_key TEXT
        CHECK (concurrency_key IS NULL
               OR (typeof(concurrency_key) = 'text' AND json_valid(concurrency_key))),
    concurrency_limit INTEGER
        CHECK ((concurrency_limit IS NULL) = (concurrency_key IS NULL)
               AND (concurrency_limit IS NULL
                    OR (typeof(concurrency_limit) = 'integer' AND concurrency_limit > 0))),
    claim_follows INTEGER NOT NULL DEFAULT 0
        CHECK (claim_follows IN (0, 1) AND (claim_follows = 0 OR claim_token IS NOT NULL)),
    -- A claim is all or nothing: no half-written lease can ever look live.
    CHECK (
        (claim_owner IS NULL AND claim_token IS NULL AND claim_expires_at_us IS NULL
         AND claim_epoch IS NULL)
        OR (claim_owner IS NOT NULL AND length(claim_owner) > 0 AND claim_token IS NOT NULL
            AND claim_expires_at_us IS NOT NULL AND claim_epoch IS NOT NULL
            AND lease_generation > 0)
    )
);

INSERT INTO tritask_tasks_v6 (rowid, task_id, row_format, record_version, record, scope,
                              revision, status, created_at_us, expires_at_us, retry_at_us,
                              claim_owner, claim_token, lease_generation, claim_expires_at_us,
                              claim_epoch, queued_message, concurrency_key, concurrency_limit,
                              claim_follows)
    SELECT rowid, task_id, row_format, record_version, record, scope, revision, status,
           created_at_us, expires_at_us, retry_at_us, claim_owner, claim_token,
           lease_generation, claim_expires_at_us, claim_epoch, queued_message, concurrency_key,
           concurrency_limit, claim_follows
    FROM tritask_tasks;

CREATE TABLE tritask_task_events_v6 (
    task_id TEXT NOT NULL
        REFERENCES tritask_tasks_v6 (task_id) ON DELETE CASCADE,
    event_id TEXT NOT NULL
        CHECK (typeof(event_id) = 'text' AND length(event_id) > 0),
    row_format INTEGER NOT NULL DEFAULT 1
        CHECK (typeof(row_format) = 'integer' AND row_format = 1),
    event TEXT NOT NULL
        CHECK (typeof(event) = 'text' AND substr(event, 1, 1) = '{'),
    event_kind TEXT NOT NULL
        CHECK (event_kind = 'input_requested' OR event_kind = 'input_responses_accepted'
               OR event_kind = 'retry_requested' OR event_kind = 'completed'
               OR event_kind = 'failed' OR event_kind = 'cancelled'
               OR event_kind = 'step_started' OR event_kind = 'step_recorded'
               OR event_kind = 'sleep_scheduled' OR event_kind = 'suspended'),
    event_revision INTEGER NOT NULL
        CHECK (typeof(event_revision) = 'integer' AND event_revision > 0),
    committed_at_us INTEGER NOT NULL
        CHECK (typeof(committed_at_us) = 'integer' AND committed_at_us >= 0),
    effects TEXT NOT NULL
        CHECK (typeof(effects) = 'text' AND substr(effects, 1, 1) = '{'),
    PRIMARY KEY (task_id, event_id),
    UNIQUE (task_id, event_revision)
);

INSERT INTO tritask_task_events_v6 (rowid, task_id, event_id, row_format, event, event_kind,
                                    event_revision, committed_at_us, effects)
    SELECT rowid, task_id, event_id, row_format, event, event_kind, event_revision,
           committed_at_us, effects
    FROM tritask_task_events;

DROP TABLE tritask_task_events;

DROP TABLE tritask_tasks;

ALTER TABLE tritask_tasks_v6 RENAME TO tritask_tasks;

ALTER TABLE tritask_task_events_v6 RENAME TO tritask_task_events;

-- The task table's indexes, as version 5 left them (their names went with the dropped
-- table). Their WHERE clauses keep IN: a two-value list is compared in place, not built into
-- a table.
CREATE INDEX tritask_tasks_recovery_queue
    ON tritask_tasks (created_at_us, task_id)
    WHERE status IN ('working', 'input_required');

CREATE INDEX tritask_tasks_retry_queue
    ON tritask_tasks (retry_at_us, created_at_us, task_id)
    WHERE status IN ('working', 'input_required') AND retry_at_us IS NOT NULL;

CREATE INDEX tritask_tasks_active_scope
    ON tritask_tasks (scope, status)
    WHERE status IN ('working', 'input_required');

CREATE INDEX tritask_tasks_ttl
    ON tritask_tasks (expires_at_us, task_id)
    WHERE expires_at_us IS NOT NULL;

CREATE INDEX tritask_tasks_key_queue
    ON tritask_tasks (concurrency_key, created_at_us, task_id)
    WHERE concurrency_key IS NOT NULL AND status IN ('working', 'input_required');

CREATE INDEX tritask_tasks_key_claims
    ON tritask_tasks (concurrency_key)
    WHERE concurrency_key IS NOT NULL AND claim_token IS NOT NULL;

CREATE INDEX tritask_tasks_owner_claims
    ON tritask_tasks (claim_owner, task_id, claim_token, lease_generation, claim_expires_at_us,
                      claim_epoch, claim_follows, revision)
    WHERE claim_owner IS NOT NULL;
