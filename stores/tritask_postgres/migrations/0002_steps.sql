-- tritask PostgreSQL store, schema version 2: durable steps (issue 16).
--
-- The ledger admits the worker events of steps. Records may now be version 4 (a task with
-- steps or a suspension): the record document carries its own version, and record_format
-- stays the row layout (3). retry_at_us now holds the instant before which the task may not be
-- claimed (a retry's or a suspension's end).

ALTER TABLE task_events DROP CONSTRAINT task_events_event_kind_check;

ALTER TABLE task_events ADD CONSTRAINT task_events_event_kind_check CHECK (event_kind IN
    ('input_requested', 'input_responses_accepted', 'retry_requested', 'completed', 'failed',
     'cancelled', 'step_started', 'step_recorded', 'sleep_scheduled', 'suspended'));
