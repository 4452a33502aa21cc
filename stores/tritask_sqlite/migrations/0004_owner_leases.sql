-- tritask_sqlite schema version 4: runner-level lease renewal (issue 15 item 3).
--
-- A claim may follow its owner's lease: its token and generation stay on the task row, its
-- expiry is the owner's row in tritask_owner_leases, so renewing every lease of a runner writes
-- one row instead of one per task. Rows written by versions 1 to 3 have claim_follows 0: their
-- expiry is claim_expires_at_us, as before.

-- 1: the claim's expiry is tritask_owner_leases.lease_expires_at_us of claim_owner (not
-- claim_expires_at_us); 0 otherwise (and always when there is no claim).
ALTER TABLE tritask_tasks ADD COLUMN claim_follows INTEGER NOT NULL DEFAULT 0
    CHECK (claim_follows IN (0, 1) AND (claim_follows = 0 OR claim_token IS NOT NULL));

-- One row per owner that renews its leases in batches: the expiry its following claims share.
CREATE TABLE tritask_owner_leases (
    owner_id TEXT PRIMARY KEY NOT NULL CHECK (typeof(owner_id) = 'text' AND owner_id <> ''),
    lease_expires_at_us INTEGER NOT NULL CHECK (typeof(lease_expires_at_us) = 'integer')
) WITHOUT ROWID;

-- renew_all reads an owner's claims from this index alone.
CREATE INDEX tritask_tasks_owner_claims
    ON tritask_tasks (claim_owner, task_id, claim_token, lease_generation, claim_expires_at_us,
                      claim_epoch, claim_follows, revision)
    WHERE claim_owner IS NOT NULL;
