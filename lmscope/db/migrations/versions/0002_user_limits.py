"""per-user limits: max_active_jobs and max_sweep_points (null = the server's default)

Revision ID: 0002
Revises: 0001
"""
from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


# recreate='never': plain ALTER TABLE ADD/DROP COLUMN (SQLite >= 3.35), never a copy of `users`,
# whose DROP TABLE would cascade to the tokens (foreign keys are on) or fail on its jobs.


def upgrade() -> None:
    with op.batch_alter_table('users', schema=None, recreate='never') as batch_op:
        batch_op.add_column(sa.Column('max_active_jobs', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('max_sweep_points', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('users', schema=None, recreate='never') as batch_op:
        batch_op.drop_column('max_sweep_points')
        batch_op.drop_column('max_active_jobs')
