-- tritask PostgreSQL store, schema version 1.
--
-- Applied by `tritask migrate --store postgresql://...` (or `tritask_postgres.migrate`) inside
-- one transaction, with `search_path` set to the target schema: names below are unqualified on
-- purpose so the schema is configurable. Never edit an applied migration; add a new file.
--
-- Instants are bigint microseconds since the Unix epoch (UTC), the contract's own instant type:
-- exact, and compared by the same integer rules as every other store. Documents are `json`, not
-- `jsonb`: `json` keeps the exact canonical text (number spelling, "\u0000" in strings), so a
-- record decodes to precisely what was written and event replay compares exact text.
-- Identifiers and scopes use the "C" collation: byte order, which for UTF-8 is code point order,
-- so `claim_next` breaks creation-time ties and `audit` pages exactly as Python orders strings.

CREATE TABLE store_metadata (
    singleton    boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    store_id     uuid        NOT NULL DEFAULT gen_random_uuid(),
    installed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

INSERT INTO store_metadata DEFAULT VALUES;

CREATE TABLE tasks (
    task_id             text     COLLATE "C" PRIMARY KEY
                                 CHECK (task_id <> '' AND octet_length(task_id) <= 256),
    record_format       smallint NOT NULL DEFAULT 3 CHECK (record_format = 3),
    record              json     NOT NULL CHECK (json_typeof(record) = 'object'),
    -- canonical JSON {"value": <scope>, "version": 1}, compared as exact text
    scope               text     COLLATE "C" NOT NULL CHECK (json_typeof(scope::json) = 'object'),
    revision            bigint   NOT NULL CHECK (revision >= 0),
    status              text     NOT NULL CHECK (status IN
                                     ('working', 'input_required', 'completed', 'failed',
                                      'cancelled')),
    created_at_us       bigint   NOT NULL CHECK (created_at_us >= 0),
    expires_at_us       bigint   CHECK (expires_at_us IS NULL OR expires_at_us >= created_at_us),
    retry_at_us         bigint,
    claim_owner         text,
    claim_token         uuid,
    lease_generation    bigint   NOT NULL DEFAULT 0 CHECK (lease_generation >= 0),
    claim_expires_at_us bigint,
    inserted_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT tasks_claim_shape CHECK (
        (claim_owner IS NULL AND claim_token IS NULL AND claim_expires_at_us IS NULL)
        OR (claim_owner IS NOT NULL AND claim_owner <> '' AND claim_token IS NOT NULL
            AND claim_expires_at_us IS NOT NULL AND lease_generation > 0)
    )
);

-- claim_next: active tasks in creation order (retry and claim deadlines are filtered).
CREATE INDEX tasks_recovery_queue ON tasks (created_at_us, task_id)
    WHERE status IN ('working', 'input_required');

-- the per-scope active-task limit
CREATE INDEX tasks_active_scope ON tasks (scope)
    WHERE status IN ('working', 'input_required');

-- reap
CREATE INDEX tasks_ttl ON tasks (expires_at_us, task_id) WHERE expires_at_us IS NOT NULL;

CREATE TABLE task_events (
    task_id         text     COLLATE "C" NOT NULL REFERENCES tasks (task_id) ON DELETE CASCADE,
    event_id        text     NOT NULL CHECK (event_id <> ''),
    row_format      smallint NOT NULL DEFAULT 1 CHECK (row_format = 1),
    event_kind      text     NOT NULL CHECK (event_kind IN
                                 ('input_requested', 'input_responses_accepted',
                                  'retry_requested', 'completed', 'failed', 'cancelled')),
    event           json     NOT NULL CHECK (json_typeof(event) = 'object'),
    event_revision  bigint   NOT NULL CHECK (event_revision > 0),
    committed_at_us bigint   NOT NULL,
    effects         json     NOT NULL CHECK (json_typeof(effects) = 'object'),
    PRIMARY KEY (task_id, event_id),
    UNIQUE (task_id, event_revision)
);

CREATE INDEX task_events_committed ON task_events (committed_at_us, task_id);
