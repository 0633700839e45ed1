"""Alembic environment: migrations run on a connection handed over by :mod:`capsa.control.store.db`."""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from capsa.control.store.models import Base

connection = context.config.attributes.get("connection")
if not isinstance(connection, Connection):
    raise RuntimeError("capsa migrations run through capsa.control.store.db.migrate(), not the alembic CLI")

context.configure(connection=connection, target_metadata=Base.metadata,
                  render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
