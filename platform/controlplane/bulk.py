"""Many rows written in about one statement's time, where a pass writes thousands (a placement
pass's device claims and events).

Django's `bulk_create` builds a model instance per row and, on PostgreSQL, one INSERT with a
placeholder per value, which psycopg splits and binds on the client: for 5,000 rows that was
half a scheduling pass. Here rows are plain tuples: PostgreSQL takes them by COPY (psycopg's
`Cursor.copy`), other databases by `executemany`. A constraint violated is Django's
`IntegrityError` either way, and the rows go in the caller's transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from django.db import connection, models


def insert_rows(model: type[models.Model], fields: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """Inserts `rows` (one value per name in `fields`, in order) into `model`'s table. Values go
    to the database as given: a JSON field's as its JSON text, a datetime as
    `connection.ops.adapt_datetimefield_value` gives it; a field left out gets its column's
    database default, not the model's (name every field the table requires)."""
    table = connection.ops.quote_name(model._meta.db_table)
    column_of = {field.name: field.column for field in model._meta.concrete_fields if field.column}
    columns = ", ".join(connection.ops.quote_name(column_of[name]) for name in fields)
    with connection.cursor() as cursor, connection.wrap_database_errors:
        if connection.vendor == "postgresql":
            with cursor.cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
        else:
            cursor.executemany(f"INSERT INTO {table} ({columns}) VALUES ({', '.join(['%s'] * len(fields))})", list(rows))
