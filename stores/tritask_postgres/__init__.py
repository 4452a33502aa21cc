"""The PostgreSQL task store for tritask: multi-host runners on one database.

``open_store("postgresql://host/db?schema=tritask", scope=...)`` (or the ``tritask.stores``
entry point behind ``tritask serve --store postgresql://...``). Apply the schema first with
``tritask migrate --store postgresql://...`` or ``await migrate(dsn, schema=...)``.
"""

from tritask.tasks.store import AuditFinding as AuditFinding
from tritask.tasks.store import AuditPage as AuditPage
from tritask.tasks.store import LedgerEntry as LedgerEntry
from tritask_postgres._migrations import DEFAULT_SCHEMA as DEFAULT_SCHEMA
from tritask_postgres._migrations import SCHEMA_VERSION as SCHEMA_VERSION
from tritask_postgres._migrations import MigrationResult as MigrationResult
from tritask_postgres._migrations import StoreSchemaError as StoreSchemaError
from tritask_postgres._migrations import latest_version as latest_version
from tritask_postgres._migrations import migrate as migrate
from tritask_postgres._store import PostgresStore as PostgresStore
from tritask_postgres._store import open_store as open_store
from tritask_postgres._wakeups import Wakeup as Wakeup
from tritask_postgres._wakeups import WakeupKind as WakeupKind

__all__ = [
    "DEFAULT_SCHEMA",
    "SCHEMA_VERSION",
    "AuditFinding",
    "AuditPage",
    "LedgerEntry",
    "MigrationResult",
    "PostgresStore",
    "StoreSchemaError",
    "Wakeup",
    "WakeupKind",
    "latest_version",
    "migrate",
    "open_store",
]
