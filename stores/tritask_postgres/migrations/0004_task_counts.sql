-- tritask PostgreSQL store, schema version 4: the task count kept by the database (issue 15).
--
-- Under max_tasks every batch of creations counted the table's rows (up to max_tasks of them,
-- live and not yet reaped) under the capacity lock, so its cost grew with the table. The count
-- is now kept in task_counts by statement-level triggers on tasks, in the inserting or deleting
-- transaction itself: in every snapshot the sum of its rows is exactly the number of committed
-- tasks, whoever wrote them (a process still running the code of schema 3 included, whose own
-- count keeps scanning the table and agrees). Sixteen rows, written by pg_backend_pid() % 16,
-- so that concurrent writers seldom wait for each other's row; a row may go negative (a task
-- inserted through one and deleted through another), only the sum means anything.

CREATE TABLE task_counts (
    shard smallint PRIMARY KEY CHECK (shard BETWEEN 0 AND 15),
    tasks bigint   NOT NULL
);

-- Seeded with the tasks present, every writer of tasks kept out until this migration commits
-- (SHARE ROW EXCLUSIVE conflicts with INSERT, UPDATE and DELETE, not with reads).
LOCK TABLE tasks IN SHARE ROW EXCLUSIVE MODE;

INSERT INTO task_counts (shard, tasks)
SELECT s, CASE WHEN s = 0 THEN (SELECT count(*) FROM tasks) ELSE 0 END
FROM generate_series(0, 15) AS s;

-- The functions resolve task_counts in the schema they were created in (search_path FROM
-- CURRENT: the migration's), whatever the writing session's search_path.
CREATE FUNCTION task_counts_added() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT AS $$
DECLARE
    n bigint;
BEGIN
    SELECT count(*) INTO n FROM added;
    IF n <> 0 THEN
        UPDATE task_counts SET tasks = tasks + n WHERE shard = pg_backend_pid() % 16;
    END IF;
    RETURN NULL;
END
$$;

CREATE FUNCTION task_counts_removed() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT AS $$
DECLARE
    n bigint;
BEGIN
    SELECT count(*) INTO n FROM removed;
    IF n <> 0 THEN
        UPDATE task_counts SET tasks = tasks - n WHERE shard = pg_backend_pid() % 16;
    END IF;
    RETURN NULL;
END
$$;

CREATE FUNCTION task_counts_emptied() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT AS $$
BEGIN
    UPDATE task_counts SET tasks = 0;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_counted_insert AFTER INSERT ON tasks
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION task_counts_added();

CREATE TRIGGER tasks_counted_delete AFTER DELETE ON tasks
    REFERENCING OLD TABLE AS removed FOR EACH STATEMENT EXECUTE FUNCTION task_counts_removed();

CREATE TRIGGER tasks_counted_truncate AFTER TRUNCATE ON tasks
    FOR EACH STATEMENT EXECUTE FUNCTION task_counts_emptied();
