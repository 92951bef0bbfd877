"""A sweep parent's progress: children finished / total, recounted from the rows."""

from __future__ import annotations

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, aliased

from lmscope.db.models import TERMINAL_STATES, Job, utcnow


def done_states(*, cancelled: bool) -> tuple[str, ...]:
    """The states of the children a sweep counts as done: every finished one, or, once the sweep is
    cancelled (or being cancelled), those that ran to an end, which says how far it got."""
    return ("succeeded", "failed") if cancelled else tuple(TERMINAL_STATES)


def children_done(counts: dict[str, int], *, cancelled: bool) -> int:
    return sum(counts.get(s, 0) for s in done_states(cancelled=cancelled))


def refresh_sweep_progress(session: Session, parent_id: int) -> None:
    """Set the parent's progress to its terminal children / all children, while it waits for them.

    Recounted (not incremented) so that a child retried after a worker crash, or reached by two
    paths (a worker finishing it and the API cancelling it), never counts twice.
    """
    # Lock the parent first: the count below then reads after any concurrent recount has committed
    # (PostgreSQL, READ COMMITTED), so the later of two recounts never stores a stale count.
    cancelling = session.execute(select(Job.cancel_requested).where(Job.id == parent_id).with_for_update()).scalar()
    child = aliased(Job)
    finished = select(func.count()).select_from(child).where(
        child.parent_id == parent_id, child.status.in_(done_states(cancelled=bool(cancelling)))).scalar_subquery()
    total = select(func.count()).select_from(child).where(child.parent_id == parent_id).scalar_subquery()
    session.execute(update(Job).where(Job.id == parent_id, Job.waiting_children.is_(True))
                    .values(progress_done=finished, progress_total=total, progress_stage="children",
                            progress_at=utcnow()))
