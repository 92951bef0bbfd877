"""SQL storage: typed models, engine/session setup and Alembic migrations."""
