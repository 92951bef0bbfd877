"""Bearer-token authentication.

A token is `lms_` + 32 random bytes (url-safe base64); only its sha256 is stored, so a database
dump reveals no usable token. It is shown once, when made (`lmscope user create NAME`).
With `LMSCOPE_AUTH=0` (the embedded single-user mode) every request acts as the admin user `local`.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

from flask import g
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from lmscope.api.errors import Problem
from lmscope.catalog import check_name
from lmscope.config import Settings
from lmscope.db.models import ApiToken, User, utcnow

TOKEN_PREFIX = "lms_"
SHOWN_PREFIX_CHARS = 12  # what `lmscope user tokens` shows of a token, and the least `user revoke --token` takes
LOCAL_USER = "local"
USER_NAME_MAX_LENGTH = 64  # users.name is VARCHAR(64)
# Refreshing last_used_at on every request would make every read a write; once a minute is enough.
_LAST_USED_RESOLUTION = timedelta(minutes=1)


@dataclass(frozen=True)
class Caller:
    """Who is making the request (a detached snapshot of the user row)."""

    id: int
    name: str
    is_admin: bool
    max_active_jobs: int | None = None  # None: the server's default (Settings)
    max_sweep_points: int | None = None

    def can_see(self, owner_id: int) -> bool:
        return self.is_admin or owner_id == self.id

    def active_jobs_limit(self, settings: Settings) -> int:
        return settings.max_active_jobs if self.max_active_jobs is None else self.max_active_jobs

    def sweep_points_limit(self, settings: Settings) -> int:
        return settings.max_sweep_points if self.max_sweep_points is None else self.max_sweep_points

    @classmethod
    def of(cls, user: User) -> Caller:
        return cls(user.id, user.name, user.is_admin, user.max_active_jobs, user.max_sweep_points)


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def issue_token(session: Session, user: User) -> str:
    """Make another token for `user`; returns the plain token (never stored)."""
    token = new_token()
    session.add(ApiToken(user_id=user.id, token_hash=hash_token(token), prefix=token[:SHOWN_PREFIX_CHARS]))
    session.flush()
    return token


def create_user(session: Session, name: str, *, admin: bool = False, max_active_jobs: int | None = None,
                max_sweep_points: int | None = None) -> tuple[User, str]:
    """Make a user and a first token; raises ValueError when the name is taken or cannot be a name
    (the rule of model and dataset names, at most 64 characters: names appear in `?user=` and listings)."""
    check_name(name, max_length=USER_NAME_MAX_LENGTH, what="a user name")  # CatalogError is a ValueError
    if session.scalar(select(User).where(User.name == name)) is not None:
        raise ValueError(f"user {name!r} exists; make another token with `lmscope user token {name}`")
    user = User(name=name, is_admin=admin, max_active_jobs=max_active_jobs, max_sweep_points=max_sweep_points)
    session.add(user)
    session.flush()
    return user, issue_token(session, user)


def user_for_token(sessions: sessionmaker, token: str) -> Caller | None:
    with sessions() as session, session.begin():
        row = session.execute(
            select(User, ApiToken.id, ApiToken.last_used_at)
            .join(ApiToken, ApiToken.user_id == User.id)
            .where(ApiToken.token_hash == hash_token(token))
        ).first()
        if row is None:
            return None
        user, token_id, last_used = row
        now = utcnow()
        if last_used is None or last_used < now - _LAST_USED_RESOLUTION:
            session.execute(update(ApiToken).where(ApiToken.id == token_id).values(last_used_at=now))
        return Caller.of(user)


def local_user(sessions: sessionmaker) -> Caller:
    """The single-user mode's admin `local`, created the first time it is needed."""
    for _ in range(2):  # a concurrent request may create it between our select and insert
        try:
            with sessions() as session, session.begin():
                user = session.scalar(select(User).where(User.name == LOCAL_USER))
                if user is None:
                    user = User(name=LOCAL_USER, is_admin=True)
                    session.add(user)
                    session.flush()
                return Caller.of(user)
        except IntegrityError:
            continue
    raise RuntimeError("could not create the local user")


def authenticate(auth_header: str | None, *, auth_enabled: bool, sessions: sessionmaker) -> Caller:
    """The caller of a request, or a 401 problem that says how to authenticate."""
    if not auth_enabled:
        return local_user(sessions)
    challenge = {"WWW-Authenticate": 'Bearer realm="lmscope"'}
    if not auth_header:
        raise Problem(401, "unauthorized", "Authentication required",
                      "send 'Authorization: Bearer <token>'; an admin makes tokens with `lmscope user create NAME` "
                      "(the client and CLI read LMSCOPE_TOKEN)", headers=challenge)
    scheme, _, token = auth_header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Problem(401, "unauthorized", "Authentication required",
                      "the Authorization header must be 'Bearer <token>'", headers=challenge)
    caller = user_for_token(sessions, token)
    if caller is None:
        raise Problem(401, "unauthorized", "Invalid token",
                      "this token is unknown or was revoked; ask an admin for a new one "
                      "(`lmscope user token NAME`)", headers={"WWW-Authenticate": 'Bearer realm="lmscope", error="invalid_token"'})
    return caller


def _host_name(host: str) -> str | None:
    """The name in a Host header ("127.0.0.1:8765" → "127.0.0.1", "[::1]:80" → "::1"), or None if unreadable."""
    try:
        return urlsplit("//" + host).hostname
    except ValueError:
        return None


def _is_ip_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def check_browser_request(method: str, headers, *, auth_enabled: bool, allowed_hosts: tuple[str, ...] = ()) -> None:
    """Without authentication, keep other web sites out (403 problems).

    Every request acts as the admin `local` then, so a page the user happens to visit could use the
    API through the user's browser: post a job or cancel one with a "simple" cross-site request (no
    preflight: a form, or text/plain), or read results through DNS rebinding (a name of its own that
    resolves to 127.0.0.1). So requests must be addressed to an IP address, localhost or a name in
    LMSCOPE_ALLOWED_HOSTS; and a request that changes something must not come from another origin
    (browsers say where a request comes from in Origin; curl and the client send none). With tokens
    a page has no credentials to send, and none of this applies.
    """
    if auth_enabled:
        return
    host = headers.get("Host", "")
    name = _host_name(host)
    if name is None or not (_is_ip_address(name) or name == "localhost" or name in allowed_hosts):
        raise Problem(403, "host-not-allowed", "Host not allowed",
                      f"this server runs without authentication (LMSCOPE_AUTH=0) and answers only requests "
                      f"addressed to an IP address or localhost, not to {host!r}: address it as "
                      f"http://127.0.0.1:<port>, list the name in the server's LMSCOPE_ALLOWED_HOSTS, or turn "
                      "authentication on (LMSCOPE_AUTH=1)")
    if method in ("GET", "HEAD", "OPTIONS"):
        return
    origin = headers.get("Origin")
    if origin is not None:
        # the page's own origin; or one of the allowed names, for a proxy that rewrites Host to localhost
        try:
            parts = urlsplit(origin)
            same = origin != "null" and (parts.netloc.lower() == host.lower() or parts.hostname in allowed_hosts)
        except ValueError:
            same = False
        cross = not same
    else:
        cross = headers.get("Sec-Fetch-Site") == "cross-site"
    if cross:
        raise Problem(403, "cross-origin-request", "Cross-origin request refused",
                      f"a page from {origin or 'another site'} may not change anything on a server without "
                      f"authentication (it would act as you); use this server's own dashboard at http://{host}/, "
                      "the CLI or the Python client, or turn authentication on (LMSCOPE_AUTH=1)")


def current_caller() -> Caller:
    return g.caller


def require_admin() -> Caller:
    caller = current_caller()
    if not caller.is_admin:
        raise Problem(403, "forbidden", "Admins only",
                      f"user {caller.name!r} is not an admin; ask an admin to do this "
                      "(admins are made with `lmscope user create NAME --admin`)")
    return caller
