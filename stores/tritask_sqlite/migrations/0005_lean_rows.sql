-- tritask_sqlite schema version 5: cheaper writes on the hot path (issue 15).
--
-- Every task writes one task row at its creation, rewrites it at its settle and inserts one
-- ledger row. Three things made those writes dearer than they need be, and none guarded
-- anything the reads do not guard again:
--
-- * json_valid() and json_type() CHECKs on the record, the scope, the event and the effects
--   parsed every JSON document in full on every insert and update (about 14% of SQLite's
--   work per task, measured with callgrind). Every value is written by tritask's own encoder
--   and every read decodes it strictly (a record, a scope, an event or effects that is not the
--   JSON object it must be is refused with CorruptStore, nothing is repaired), so the columns
--   now check only their type and shape: TEXT starting with '{'. The rarely written queued
--   message and concurrency key keep their json_valid() CHECKs.
-- * tritask_task_events_committed (committed_at_us, task_id) was read by no query: a fourth
--   b-tree written by every ledger insert. It is dropped.
-- * tritask_tasks_active_scope gains the status column, so the count of a scope's active
--   tasks made by every creation under max_active_tasks_per_scope is covered by the index.
--
-- SQLite cannot alter a CHECK, so both tables are rebuilt with the same columns, rows (rowids
-- too), keys and the other indexes. The ledger is rebuilt first, referencing the new task
-- table, and the old tables are dropped child first, so dropping the old task table (an
-- implicit DELETE under foreign_keys = ON) cascades into no ledger; renaming the new task
-- table then renames the ledger's reference with it (legacy_alter_table off, SQLite >= 3.26).

PRAGMA legacy_alter_table = OFF;

CREATE TABLE tritask_tasks_v5 (
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

INSERT INTO tritask_tasks_v5 (rowid, task_id, row_format, record_version, record, scope,
                              revision, status, created_at_us, expires_at_us, retry_at_us,
                              claim_owner, claim_token, lease_generation, claim_expires_at_us,
                              claim_epoch, queued_message, concurrency_key, concurrency_limit,
                              claim_follows)
    SELECT rowid, task_id, row_format, record_version, record, scope, revision, status,
           created_at_us, expires_at_us, retry_at_us, claim_owner, claim_token,
           lease_generation, claim_expires_at_us, claim_epoch, queued_message, concurrency_key,
           concurrency_limit, claim_follows
    FROM tritask_tasks;

CREATE TABLE tritask_task_events_v5 (
    task_id TEXT NOT NULL
        REFERENCES tritask_tasks_v5 (task_id) ON DELETE CASCADE,
    event_id TEXT NOT NULL
        CHECK (typeof(event_id) = 'text' AND length(event_id) > 0),
    row_format INTEGER NOT NULL DEFAULT 1
        CHECK (typeof(row_format) = 'integer' AND row_format = 1),
    event TEXT NOT NULL
        CHECK (typeof(event) = 'text' AND substr(event, 1, 1) = '{'),
    event_kind TEXT NOT NULL
        CHECK (event_kind IN ('input_requested', 'input_responses_accepted', 'retry_requested',
                              'completed', 'failed', 'cancelled', 'step_started',
                              'step_recorded', 'sleep_scheduled', 'suspended')),
    event_revision INTEGER NOT NULL
        CHECK (typeof(event_revision) = 'integer' AND event_revision > 0),
    committed_at_us INTEGER NOT NULL
        CHECK (typeof(committed_at_us) = 'integer' AND committed_at_us >= 0),
    effects TEXT NOT NULL
        CHECK (typeof(effects) = 'text' AND substr(effects, 1, 1) = '{'),
    PRIMARY KEY (task_id, event_id),
    UNIQUE (task_id, event_revision)
);

INSERT INTO tritask_task_events_v5 (rowid, task_id, event_id, row_format, event, event_kind,
                                    event_revision, committed_at_us, effects)
    SELECT rowid, task_id, event_id, row_format, event, event_kind, event_revision,
           committed_at_us, effects
    FROM tritask_task_events;

DROP TABLE tritask_task_events;

DROP TABLE tritask_tasks;

ALTER TABLE tritask_tasks_v5 RENAME TO tritask_tasks;

ALTER TABLE tritask_task_events_v5 RENAME TO tritask_task_events;

-- The task table's indexes, as versions 1, 3 and 4 made them (their names went with the
-- dropped table).
CREATE INDEX tritask_tasks_recovery_queue
    ON tritask_tasks (created_at_us, task_id)
    WHERE status IN ('working', 'input_required');

CREATE INDEX tritask_tasks_retry_queue
    ON tritask_tasks (retry_at_us, created_at_us, task_id)
    WHERE status IN ('working', 'input_required') AND retry_at_us IS NOT NULL;

-- Now with the status: the count under max_active_tasks_per_scope reads the index alone
-- (on (scope) only, SQLite read every active task's row to check its status again).
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
