-- tritask_sqlite schema version 1. Immutable once released: later changes are new migrations.
--
-- Instants are integer epoch microseconds. JSON columns are TEXT holding a JSON object. Every
-- column states its type with typeof() so a foreign writer cannot slip in a REAL or a BLOB.

CREATE TABLE tritask_metadata (
    singleton INTEGER PRIMARY KEY NOT NULL
        CHECK (typeof(singleton) = 'integer' AND singleton = 1),
    schema_version INTEGER NOT NULL
        CHECK (typeof(schema_version) = 'integer' AND schema_version > 0),
    store_id TEXT NOT NULL
        CHECK (typeof(store_id) = 'text' AND length(store_id) = 36),
    boot_epoch INTEGER NOT NULL DEFAULT 0
        CHECK (typeof(boot_epoch) = 'integer' AND boot_epoch >= 0),
    installed_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP
        CHECK (typeof(installed_at) = 'text')
);

CREATE TABLE tritask_tasks (
    task_id TEXT PRIMARY KEY NOT NULL
        CHECK (typeof(task_id) = 'text' AND length(task_id) > 0),
    row_format INTEGER NOT NULL DEFAULT 1
        CHECK (typeof(row_format) = 'integer' AND row_format = 1),
    record_version INTEGER NOT NULL
        CHECK (typeof(record_version) = 'integer' AND record_version > 0),
    record TEXT NOT NULL
        CHECK (typeof(record) = 'text' AND json_valid(record) AND json_type(record) = 'object'),
    scope TEXT NOT NULL
        CHECK (typeof(scope) = 'text' AND json_valid(scope) AND json_type(scope) = 'object'),
    revision INTEGER NOT NULL
        CHECK (typeof(revision) = 'integer' AND revision >= 0),
    status TEXT NOT NULL
        CHECK (status IN ('working', 'input_required', 'completed', 'failed', 'cancelled')),
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
    -- A claim is all or nothing: no half-written lease can ever look live.
    CHECK (
        (claim_owner IS NULL AND claim_token IS NULL AND claim_expires_at_us IS NULL
         AND claim_epoch IS NULL)
        OR (claim_owner IS NOT NULL AND length(claim_owner) > 0 AND claim_token IS NOT NULL
            AND claim_expires_at_us IS NOT NULL AND claim_epoch IS NOT NULL
            AND lease_generation > 0)
    )
);

-- claim_next: the oldest active task, by (created_at, task_id).
CREATE INDEX tritask_tasks_recovery_queue
    ON tritask_tasks (created_at_us, task_id)
    WHERE status IN ('working', 'input_required');

CREATE INDEX tritask_tasks_retry_queue
    ON tritask_tasks (retry_at_us, created_at_us, task_id)
    WHERE status IN ('working', 'input_required') AND retry_at_us IS NOT NULL;

-- max_active_tasks_per_scope is counted inside the write transaction.
CREATE INDEX tritask_tasks_active_scope
    ON tritask_tasks (scope)
    WHERE status IN ('working', 'input_required');

-- reap: expired aggregates in deadline order.
CREATE INDEX tritask_tasks_ttl
    ON tritask_tasks (expires_at_us, task_id)
    WHERE expires_at_us IS NOT NULL;

-- The ledger: one row per applied event, kept for audit and for event-id replay.
CREATE TABLE tritask_task_events (
    task_id TEXT NOT NULL
        REFERENCES tritask_tasks (task_id) ON DELETE CASCADE,
    event_id TEXT NOT NULL
        CHECK (typeof(event_id) = 'text' AND length(event_id) > 0),
    row_format INTEGER NOT NULL DEFAULT 1
        CHECK (typeof(row_format) = 'integer' AND row_format = 1),
    event TEXT NOT NULL
        CHECK (typeof(event) = 'text' AND json_valid(event) AND json_type(event) = 'object'),
    event_kind TEXT NOT NULL
        CHECK (event_kind IN ('input_requested', 'input_responses_accepted', 'retry_requested',
                              'completed', 'failed', 'cancelled')),
    event_revision INTEGER NOT NULL
        CHECK (typeof(event_revision) = 'integer' AND event_revision > 0),
    committed_at_us INTEGER NOT NULL
        CHECK (typeof(committed_at_us) = 'integer' AND committed_at_us >= 0),
    effects TEXT NOT NULL
        CHECK (typeof(effects) = 'text' AND json_valid(effects) AND json_type(effects) = 'object'),
    PRIMARY KEY (task_id, event_id),
    UNIQUE (task_id, event_revision)
);

CREATE INDEX tritask_task_events_committed
    ON tritask_task_events (committed_at_us, task_id);
