"""series.points (each curve's length, to size answers before loading them) and the job list's indexes

Revision ID: 0003
Revises: 0002
"""
from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # recreate='never': plain ALTER TABLE ADD/DROP COLUMN, never a copy of a table that may hold millions of rows
    with op.batch_alter_table('series', schema=None, recreate='never') as batch_op:
        batch_op.add_column(sa.Column('points', sa.Integer(), nullable=True))  # NULL: counted when read
    # json_array_length: SQLite's JSON1 and PostgreSQL's json both have it
    op.execute("UPDATE series SET points = json_array_length(x)")
    op.create_index('ix_jobs_kind_id', 'jobs', ['kind', 'id'])
    op.create_index('ix_jobs_user_id_kind_id', 'jobs', ['user_id', 'kind', 'id'])
    op.create_index('ix_jobs_user_id_status_id', 'jobs', ['user_id', 'status', 'id'])


def downgrade() -> None:
    op.drop_index('ix_jobs_user_id_status_id', table_name='jobs')
    op.drop_index('ix_jobs_user_id_kind_id', table_name='jobs')
    op.drop_index('ix_jobs_kind_id', table_name='jobs')
    with op.batch_alter_table('series', schema=None, recreate='never') as batch_op:
        batch_op.drop_column('points')
