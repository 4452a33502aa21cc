-- tritask_sqlite schema version 2: durable steps (issue 16).
--
-- The ledger admits the worker events of steps: step_started, step_recorded, sleep_scheduled
-- and suspended. SQLite cannot alter a CHECK constraint, so the ledger table is rebuilt with
-- the same columns, rows, keys and index. Records may now be version 4 (a task with steps or a
-- suspension); record_version's CHECK (> 0) already admits it, and retry_at_us now holds the
-- instant before which the task may not be claimed (a retry's or a suspension's end).

CREATE TABLE tritask_task_events_v2 (
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
                              'completed', 'failed', 'cancelled', 'step_started',
                              'step_recorded', 'sleep_scheduled', 'suspended')),
    event_revision INTEGER NOT NULL
        CHECK (typeof(event_revision) = 'integer' AND event_revision > 0),
    committed_at_us INTEGER NOT NULL
        CHECK (typeof(committed_at_us) = 'integer' AND committed_at_us >= 0),
    effects TEXT NOT NULL
        CHECK (typeof(effects) = 'text' AND json_valid(effects) AND json_type(effects) = 'object'),
    PRIMARY KEY (task_id, event_id),
    UNIQUE (task_id, event_revision)
);

INSERT INTO tritask_task_events_v2 (task_id, event_id, row_format, event, event_kind,
                                    event_revision, committed_at_us, effects)
    SELECT task_id, event_id, row_format, event, event_kind, event_revision, committed_at_us,
           effects
    FROM tritask_task_events;

DROP TABLE tritask_task_events;

ALTER TABLE tritask_task_events_v2 RENAME TO tritask_task_events;

CREATE INDEX tritask_task_events_committed
    ON tritask_task_events (committed_at_us, task_id);
